//! Scenario 11: `roam run` (issue 13: an unmodified program's connections
//! carried by interposition) against plain TCP and against `roam forward`,
//! between two hosts.
//!
//! `roam run -- CMD` hands CMD's outgoing connections to non-loopback
//! addresses to an agent in the `roam run` process (its preload library
//! redirects them), so the target must be on another host: a LAN
//! (roam-sim's `Lan`) of a client host and a server host, each a network
//! namespace, made for the scenario and removed afterwards (also when it
//! fails or runs out of time: the `Lan` guard kills every process in it).
//! On the server host run the harness's target (sink, source, echo) on the
//! host's LAN address and `roam serve` on 0.0.0.0:7447 allowing it. On the
//! client host a measuring client process (`roam-bench agent
//! interpose-client`, driving the same load generator as the other
//! scenarios) runs four ways, alternating within every round (order
//! rotated):
//!
//! - `direct`: plain, to the target's LAN address;
//! - `roam-run`: `roam run -- <client>`, to the same address: the agent
//!   probes the server host's relay port, finds `roam serve`, and carries
//!   every connection as a stream of one session; the process's first
//!   connection waits for the probe and the Noise handshake, later ones are
//!   new streams of that session;
//! - `roam-run-ordinary`: the same with `--relay-port` on a port nothing
//!   listens on: the probe is refused, the host counts as ordinary, and the
//!   agent carries the connections as plain TCP (what `roam run` costs
//!   towards a host without roam);
//! - `roam-forward`: the client connects to `roam forward` on the client
//!   host's 127.0.0.1, which makes each connection a new stream of its
//!   session to the same `roam serve` (started once, its session set up
//!   before the rounds).
//!
//! Each client process times its first connection (connect until a 1-byte
//! echo returns), then `later` more connections the same way, then 1-byte
//! ping-pongs on one echo connection (TCP_NODELAY, after a warm-up), then an
//! upload to the sink and a download from the source in 64 KiB writes,
//! each checked to the byte (the sink's count; the source's end marker and
//! count). More processes per round time their first connection only, so
//! that it has more samples than rounds. What `roam run` says is checked:
//! the `roam-run` processes' connections went through a roam session, the
//! `roam-run-ordinary` ones' did not.
//!
//! Needs root, iproute2 and nsenter; skipped with the reason otherwise.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use roam_sim::netns::{self, Lan};
use serde::{Deserialize, Serialize};

use super::{progress, RatioRow};
use crate::agent::Agent;
use crate::load;
use crate::peers::{order, Env, Lab, DIRECT, ROAM_FORWARD};
use crate::procs::Proc;
use crate::stats::{ratio, summary, Summary};
use crate::Ctx;

/// The client under `roam run`, to a host running `roam serve`.
pub(crate) const ROAM_RUN: &str = "roam-run";
/// The client under `roam run`, to a host whose relay port is closed.
pub(crate) const ROAM_RUN_ORDINARY: &str = "roam-run-ordinary";

/// The LAN's client host.
const CLIENT: usize = 0;
/// The LAN's server host.
const SERVER: usize = 1;
/// `roam serve`'s port on the server host (`roam run`'s default relay port).
const RELAY_PORT: u16 = 7447;
/// A port nothing listens on at the server host: `roam-run-ordinary`'s
/// relay port (the probe gets a reset: an ordinary host).
const CLOSED_PORT: u16 = 7449;
/// `roam forward`'s port on the client host's 127.0.0.1.
const FORWARD_PORT: u16 = 7500;
/// Write size of the bulk transfers (bytes).
pub(crate) const BLOCK: usize = 64 * 1024;
/// Ping-pongs before the measured ones.
pub(crate) const WARMUP: usize = 50;
/// Longest a client process may measure for (its own bound).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);
/// Longest the harness waits for a client process (a little more than its
/// own bound: it then reports its error itself).
const CLIENT_WAIT: Duration = Duration::from_secs(130);
/// How long a long-lived process may take to be ready.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Whose figures each ratio divides: `(roam, versus)`.
pub(crate) const PAIRS: [(&str, &str); 4] = [
    (ROAM_RUN, DIRECT),
    (ROAM_RUN, ROAM_FORWARD),
    (ROAM_FORWARD, DIRECT),
    (ROAM_RUN_ORDINARY, DIRECT),
];

/// The measurements a ratio is made of, as the report's columns name them.
pub(crate) const CASES: [&str; 6] = [
    "first connection",
    "later connection",
    "RTT p50",
    "RTT p99",
    "upload",
    "download",
];

/// The measuring client's arguments (`roam-bench agent interpose-client`).
#[derive(Debug, clap::Args)]
pub(crate) struct ClientArgs {
    /// The target (sink, source, echo) as the program connects to it.
    #[arg(long)]
    pub(crate) target: SocketAddr,
    /// Connections after the first, each timed until a 1-byte echo returns.
    #[arg(long, default_value_t = 0)]
    pub(crate) later: usize,
    /// Measured 1-byte round trips on one echo connection (0: none).
    #[arg(long, default_value_t = 0)]
    pub(crate) round_trips: usize,
    /// Seconds of each bulk transfer, an upload then a download (0: none).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) seconds: f64,
}

/// What one client process measured: its line of JSON on stdout.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ClientReport {
    /// The process's first connection: connect until a 1-byte echo
    /// returns, µs.
    pub(crate) first_us: f64,
    /// The same for each later connection, µs.
    pub(crate) later_us: Vec<f64>,
    /// 1-byte round trips on one echo connection after the warm-up, µs.
    pub(crate) rtt_us: Vec<f64>,
    /// The upload's MB/s (10^6 bytes), confirmed by the sink's count.
    pub(crate) upload_mbps: Option<f64>,
    /// The download's MB/s, every byte and the source's count checked.
    pub(crate) download_mbps: Option<f64>,
}

/// Runs the client's measurements (in the `interpose-client` agent),
/// bounded by [`CLIENT_TIMEOUT`].
pub(crate) async fn client(args: &ClientArgs) -> io::Result<ClientReport> {
    tokio::time::timeout(CLIENT_TIMEOUT, measure(args))
        .await
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the measurements took more than {CLIENT_TIMEOUT:?}"),
            )
        })?
}

/// The client's measurements, in order: first connection, later
/// connections, round trips, upload, download.
async fn measure(args: &ClientArgs) -> io::Result<ClientReport> {
    let t = args.target;
    let what = |w: &str, e: io::Error| io::Error::new(e.kind(), format!("{w} to {t}: {e}"));
    let first_us = connect_echo(t)
        .await
        .map_err(|e| what("first connection", e))?;
    let mut later_us = Vec::with_capacity(args.later);
    for i in 0..args.later {
        later_us.push(
            connect_echo(t)
                .await
                .map_err(|e| what(&format!("connection {}", i + 2), e))?,
        );
    }
    let mut rtt_us = Vec::new();
    if args.round_trips > 0 {
        let rtts = async {
            let mut c = load::tcp(t, true).await?;
            load::start_echo(&mut c).await?;
            load::ping_pong(&mut c, 1, WARMUP, args.round_trips).await
        }
        .await
        .map_err(|e| what("1-byte ping-pong", e))?;
        rtt_us = rtts.iter().map(|&ns| ns as f64 / 1000.0).collect();
    }
    let (mut upload_mbps, mut download_mbps) = (None, None);
    if args.seconds > 0.0 {
        let d = Duration::from_secs_f64(args.seconds);
        // Bulk clients keep Nagle on, as in scenario 1.
        let up = async {
            let mut c = load::tcp(t, false).await?;
            load::upload(&mut c, BLOCK, d, None).await
        }
        .await
        .map_err(|e| what("upload", e))?;
        upload_mbps = Some(up.mbps());
        let down = async {
            let mut c = load::tcp(t, false).await?;
            load::download(&mut c, BLOCK, d).await
        }
        .await
        .map_err(|e| what("download", e))?;
        download_mbps = Some(down.mbps());
    }
    Ok(ClientReport {
        first_us,
        later_us,
        rtt_us,
        upload_mbps,
        download_mbps,
    })
}

/// Connects to `t` and completes a 1-byte echo: the time taken, µs.
async fn connect_echo(t: SocketAddr) -> io::Result<f64> {
    let start = Instant::now();
    let mut c = load::tcp(t, true).await?;
    load::echo_once(&mut c).await?;
    Ok(start.elapsed().as_secs_f64() * 1e6)
}

/// One way's figures over every round.
#[derive(Debug, Serialize)]
pub(crate) struct Row {
    /// The way's name (`direct`, `roam-run`, ...).
    pub(crate) peer: &'static str,
    /// The path of one connection.
    pub(crate) path: &'static str,
    /// A fresh process's first connection until its 1-byte echo, µs.
    pub(crate) first_us: Summary,
    /// Each later connection of a process until its 1-byte echo, µs.
    pub(crate) later_us: Summary,
    /// 1-byte round trips, µs.
    pub(crate) rtt_us: Summary,
    /// Upload, MB/s per process.
    pub(crate) upload_mbps: Summary,
    /// Download, MB/s per process.
    pub(crate) download_mbps: Summary,
}

impl Row {
    /// The figure a ratio of `case` (one of [`CASES`]) divides.
    pub(crate) fn figure(&self, case: &str) -> f64 {
        match case {
            "first connection" => self.first_us.median,
            "later connection" => self.later_us.median,
            "RTT p50" => self.rtt_us.median,
            "RTT p99" => self.rtt_us.p99,
            "upload" => self.upload_mbps.median,
            "download" => self.download_mbps.median,
            _ => f64::NAN,
        }
    }
}

/// The scenario's result.
#[derive(Debug, Serialize)]
pub(crate) struct Interpose {
    /// Rounds: each runs every way's client once in full, order rotated.
    pub(crate) rounds: usize,
    /// First-connection samples per way and round (the full process's and
    /// those of processes that time only their first connection).
    pub(crate) first_per_round: usize,
    /// Later connections per full process.
    pub(crate) later_per_process: usize,
    /// Measured 1-byte round trips per full process.
    pub(crate) round_trips_per_process: usize,
    /// Round trips before the measured ones.
    pub(crate) warmup_round_trips: usize,
    /// Seconds of each upload and download.
    pub(crate) seconds_per_transfer: f64,
    /// Write size of the transfers (bytes).
    pub(crate) block_bytes: usize,
    /// The target's address on the server host (the LAN's subnet differs
    /// per run).
    pub(crate) target: String,
    /// One row per way.
    pub(crate) rows: Vec<Row>,
    /// Medians (p99 for "RTT p99") of [`PAIRS`] divided, per case of
    /// [`CASES`]: below 1 is better for the first peer in times, above 1 in
    /// MB/s.
    pub(crate) ratios: Vec<RatioRow>,
}

/// How a way's client reaches the target.
#[derive(Debug, Clone, Copy)]
enum How {
    /// Plain, to the target's address.
    Direct,
    /// Under `roam run` with this relay port; `expect` is what `roam run`
    /// must have said on stderr (that the connections were carried as the
    /// way means).
    Run {
        /// `--relay-port`: where the agent probes the server host.
        relay_port: u16,
        /// A phrase `roam run`'s stderr must hold.
        expect: &'static str,
        /// Phrases it must not hold.
        reject: &'static [&'static str],
    },
    /// To `roam forward` on the client host's loopback.
    Forward,
}

/// One way of connecting, under its result name.
struct Way {
    /// The result name (`direct`, `roam-run`, ...).
    name: &'static str,
    /// The path of one connection, for the report.
    path: &'static str,
    /// How its client is started and what it connects to.
    how: How,
}

/// Every way, in a fixed order.
fn ways() -> Vec<Way> {
    vec![
        Way {
            name: DIRECT,
            path: "client -> target (plain TCP between the hosts)",
            how: How::Direct,
        },
        Way {
            name: ROAM_RUN,
            path: "client (under roam run) -> roam run's agent -> roam session -> roam serve -> target",
            how: How::Run {
                relay_port: RELAY_PORT,
                expect: "runs a roam relay",
                reject: &["is an ordinary host", "goes direct"],
            },
        },
        Way {
            name: ROAM_RUN_ORDINARY,
            path: "client (under roam run, relay port closed: an ordinary host) -> roam run's agent -> plain TCP -> target",
            how: How::Run {
                relay_port: CLOSED_PORT,
                expect: "is an ordinary host",
                reject: &["runs a roam relay"],
            },
        },
        Way {
            name: ROAM_FORWARD,
            path: "client -> roam forward (127.0.0.1, session made before) -> roam serve -> target",
            how: How::Forward,
        },
    ]
}

/// The two hosts and the long-lived processes on them. Fields drop in
/// order: the processes end before their namespaces go.
struct Hosts {
    /// `roam forward` on the client host (when `roam-forward` takes part).
    forward: Option<Proc>,
    /// `roam serve` on the server host.
    _serve: Proc,
    /// The target agent on the server host.
    _targets: Agent,
    /// The target's address.
    target: SocketAddr,
    /// The client host's roam state (key, pinned relay key, preload library).
    client_state: PathBuf,
    /// The namespaces; dropping kills what is left in them and deletes them.
    lan: Lan,
}

/// The error that makes `main` report the scenario as skipped.
fn skip(why: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, why.to_string())
}

/// A command running `program` inside network namespace `ns`.
fn in_ns(ns: &str, program: &Path) -> std::process::Command {
    let mut c = std::process::Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{ns}"))
        .arg("--")
        .arg(program)
        .env_remove("RUST_LOG");
    c
}

/// The last `n` lines of `text`, for error messages.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return "(no output)".into();
    }
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// Waits until `log` has a line containing `needle` (the process said it
/// is ready), checking that `proc` lives.
async fn wait_for_line(proc: &Proc, log: &Path, needle: &str) -> io::Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(needle) {
            return Ok(());
        }
        proc.check_alive()
            .map_err(|e| io::Error::other(format!("{e}: {}", tail(&text, 5))))?;
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "no {needle:?} in {} within {START_TIMEOUT:?}: {}",
                    log.display(),
                    tail(&text, 5)
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

impl Hosts {
    /// Makes the LAN and starts the target, `roam serve` and (if
    /// `forward`) `roam forward`.
    async fn start(env: &Env, forward: bool) -> io::Result<Hosts> {
        let lan = tokio::task::spawn_blocking(|| Lan::new("bench_interpose", 2))
            .await
            .map_err(io::Error::other)??;
        let listen = SocketAddr::from((lan.addr(SERVER), 0)).to_string();
        let mut targets = Agent::spawn_in(
            lan.ns(SERVER),
            &env.me,
            &["targets", "--listen", &listen],
            &env.log("interpose-targets"),
        )?;
        let target = targets.addr().await?;

        let relay_state = env.dir.join("interpose-relay-state");
        std::fs::create_dir_all(&relay_state)?;
        let log = env.log("interpose-serve");
        let mut cmd = in_ns(lan.ns(SERVER), &env.roam);
        env.roam_env(&mut cmd, &relay_state);
        cmd.arg("serve")
            .arg("--listen")
            .arg(format!("0.0.0.0:{RELAY_PORT}"))
            .arg("--allow")
            .arg(target.to_string());
        let serve = Proc::spawn("roam serve (interpose)", &mut cmd, Some(&log))?;
        wait_for_line(&serve, &log, "listening on").await?;

        // One client key, made before any roam client runs.
        let client_state = env.dir.join("interpose-client-state");
        std::fs::create_dir_all(&client_state)?;
        let st = env
            .roam_cmd(&client_state)
            .arg("keygen")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?;
        if !st.success() {
            return Err(io::Error::other(format!("roam keygen failed ({st})")));
        }
        let forward = if forward {
            let log = env.log("interpose-forward");
            let mut cmd = in_ns(lan.ns(CLIENT), &env.roam);
            env.roam_env(&mut cmd, &client_state);
            cmd.arg("forward")
                .arg(format!("{}:{RELAY_PORT}", lan.addr(SERVER)))
                .arg(format!("127.0.0.1:{FORWARD_PORT}"))
                .arg(target.to_string());
            let p = Proc::spawn("roam forward (interpose)", &mut cmd, Some(&log))?;
            // Printed once its session is up.
            wait_for_line(&p, &log, &format!("-> {target} via")).await?;
            Some(p)
        } else {
            None
        };
        // The client host reaches the target (and knows its link-layer
        // address before anything is timed).
        lan.tcp_connect(CLIENT, target, Duration::from_secs(5))
            .map_err(|e| io::Error::new(e.kind(), format!("client host to {target}: {e}")))?;
        Ok(Hosts {
            forward,
            _serve: serve,
            _targets: targets,
            target,
            client_state,
            lan,
        })
    }

    /// Runs one client process the way `way` says, with the agent's
    /// arguments `args`; checks its exit, what `roam run` said, and its
    /// report.
    async fn client(&self, env: &Env, way: &Way, args: &[String]) -> io::Result<ClientReport> {
        let ns = self.lan.ns(CLIENT);
        let (mut cmd, target) = match way.how {
            How::Direct => (in_ns(ns, &env.me), self.target),
            How::Run { relay_port, .. } => {
                let mut c = in_ns(ns, &env.roam);
                env.roam_env(&mut c, &self.client_state);
                c.arg("run")
                    .arg("--relay-port")
                    .arg(relay_port.to_string())
                    .arg("--")
                    .arg(&env.me);
                (c, self.target)
            }
            How::Forward => {
                if self.forward.is_none() {
                    return Err(io::Error::other("roam forward was not started"));
                }
                (
                    in_ns(ns, &env.me),
                    SocketAddr::from(([127, 0, 0, 1], FORWARD_PORT)),
                )
            }
        };
        {
            use std::os::unix::process::CommandExt;
            cmd.arg("agent")
                .arg("interpose-client")
                .arg("--target")
                .arg(target.to_string())
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0);
        }
        let mut cmd = tokio::process::Command::from(cmd);
        cmd.kill_on_drop(true);
        let child = cmd
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("{}: cannot start: {e}", way.name)))?;
        let pid = child.id();
        let out = match tokio::time::timeout(CLIENT_WAIT, child.wait_with_output()).await {
            Ok(r) => r?,
            Err(_) => {
                // The child itself was killed as it dropped; its group too
                // (`roam run`'s program).
                if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
                    let _ = nix::sys::signal::killpg(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "{}: the client did not end within {CLIENT_WAIT:?}",
                        way.name
                    ),
                ));
            }
        };
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "{}: the client failed ({}): {}",
                way.name,
                out.status,
                tail(&stderr, 6)
            )));
        }
        if let How::Run { expect, reject, .. } = way.how {
            if !stderr.contains(expect) || reject.iter().any(|r| stderr.contains(r)) {
                return Err(io::Error::other(format!(
                    "{}: the connections were not carried as meant (roam run should say {expect:?}, \
                     and none of {reject:?}): {}",
                    way.name,
                    tail(&stderr, 6)
                )));
            }
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .ok_or_else(|| io::Error::other(format!("{}: the client printed nothing", way.name)))?;
        serde_json::from_str(line).map_err(|e| {
            io::Error::other(format!("{}: the client printed {line:?}: {e}", way.name))
        })
    }
}

/// Every way's samples so far.
#[derive(Default)]
struct Samples {
    /// First connections, µs (one per process).
    first: Vec<f64>,
    /// Later connections, µs.
    later: Vec<f64>,
    /// 1-byte round trips, µs.
    rtt: Vec<f64>,
    /// Uploads, MB/s (one per full process).
    upload: Vec<f64>,
    /// Downloads, MB/s (one per full process).
    download: Vec<f64>,
}

impl Samples {
    /// Adds one client process's report.
    fn add(&mut self, r: ClientReport) {
        self.first.push(r.first_us);
        self.later.extend(r.later_us);
        self.rtt.extend(r.rtt_us);
        self.upload.extend(r.upload_mbps);
        self.download.extend(r.download_mbps);
    }
}

/// Runs the scenario: the hosts, the rounds, the figures and their ratios.
/// The loopback peers of `_lab` take no part.
pub(crate) async fn run(ctx: Arc<Ctx>, _lab: Arc<Lab>) -> io::Result<Interpose> {
    tokio::task::spawn_blocking(netns::available)
        .await
        .map_err(io::Error::other)?
        .map_err(skip)?;
    if !netns::installed("nsenter") {
        return Err(skip("nsenter is not installed"));
    }
    let plan = &ctx.plan;
    let env = &ctx.env;
    let ways: Vec<Way> = ways().into_iter().filter(|w| ctx.wants(w.name)).collect();
    let hosts = Hosts::start(env, ways.iter().any(|w| w.name == ROAM_FORWARD)).await?;
    let target = hosts.target.to_string();
    let result = measure_ways(&ctx, &hosts, &ways).await;
    // Whatever happened: the processes end, the namespaces go.
    tokio::task::spawn_blocking(move || drop(hosts))
        .await
        .map_err(io::Error::other)?;
    let samples = result?;

    let rows: Vec<Row> = ways
        .iter()
        .zip(samples)
        .map(|(w, s)| Row {
            peer: w.name,
            path: w.path,
            first_us: summary(&s.first),
            later_us: summary(&s.later),
            rtt_us: summary(&s.rtt),
            upload_mbps: summary(&s.upload),
            download_mbps: summary(&s.download),
        })
        .collect();
    for r in &rows {
        progress(&format!(
            "interpose {}: first connection {:.2} ms, later {:.3} ms, RTT p50 {:.0} µs p99 {:.0} µs, \
             upload {:.0} MB/s, download {:.0} MB/s",
            r.peer,
            r.first_us.median / 1e3,
            r.later_us.median / 1e3,
            r.rtt_us.median,
            r.rtt_us.p99,
            r.upload_mbps.median,
            r.download_mbps.median
        ));
    }
    let ratios = ratios(&rows);
    Ok(Interpose {
        rounds: plan.interpose_rounds,
        first_per_round: plan.interpose_first_per_round,
        later_per_process: plan.interpose_later,
        round_trips_per_process: plan.interpose_round_trips,
        warmup_round_trips: WARMUP,
        seconds_per_transfer: plan.interpose_seconds,
        block_bytes: BLOCK,
        target,
        rows,
        ratios,
    })
}

/// The rounds: every way's full client once per round, then its
/// first-connection-only clients, in rotated order; an uncounted
/// first-connection client of each way before them (the preload library
/// written to the state directory, the relay's key pinned, the binaries
/// read).
async fn measure_ways(ctx: &Ctx, hosts: &Hosts, ways: &[Way]) -> io::Result<Vec<Samples>> {
    let plan = &ctx.plan;
    let env = &ctx.env;
    let first_only: Vec<String> = Vec::new();
    let full: Vec<String> = vec![
        "--later".into(),
        plan.interpose_later.to_string(),
        "--round-trips".into(),
        plan.interpose_round_trips.to_string(),
        "--seconds".into(),
        plan.interpose_seconds.to_string(),
    ];
    for w in ways {
        hosts.client(env, w, &first_only).await?;
    }
    let mut samples: Vec<Samples> = ways.iter().map(|_| Samples::default()).collect();
    let rounds = plan.interpose_rounds;
    for round in 0..rounds {
        for i in order(ways.len(), round) {
            samples[i].add(hosts.client(env, &ways[i], &full).await?);
        }
        for k in 1..plan.interpose_first_per_round {
            for i in order(ways.len(), round + k) {
                samples[i].add(hosts.client(env, &ways[i], &first_only).await?);
            }
        }
        progress(&format!("interpose round {}/{rounds} done", round + 1));
    }
    Ok(samples)
}

/// The ratios of [`PAIRS`] for every case of [`CASES`] (NaN where a way
/// did not take part).
fn ratios(rows: &[Row]) -> Vec<RatioRow> {
    let figure = |peer: &str, case: &str| {
        rows.iter()
            .find(|r| r.peer == peer)
            .map_or(f64::NAN, |r| r.figure(case))
    };
    let mut v = Vec::new();
    for (a, b) in PAIRS {
        for case in CASES {
            v.push(RatioRow {
                case: case.to_string(),
                roam: a.to_string(),
                versus: b.to_string(),
                ratio: ratio(figure(a, case), figure(b, case)),
            });
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The client's measurements against a target on loopback: every
    /// figure present, and its report survives the trip through JSON.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_client_measures_every_figure_and_reports_in_json() {
        let l = load::target_listener().unwrap();
        let target = l.local_addr().unwrap();
        tokio::spawn(load::serve_targets(l));
        let r = client(&ClientArgs {
            target,
            later: 3,
            round_trips: 20,
            seconds: 0.05,
        })
        .await
        .unwrap();
        assert!(r.first_us > 0.0);
        assert_eq!(r.later_us.len(), 3);
        assert_eq!(r.rtt_us.len(), 20);
        assert!(r.upload_mbps.is_some_and(|x| x > 0.0));
        assert!(r.download_mbps.is_some_and(|x| x > 0.0));
        let line = serde_json::to_string(&r).unwrap();
        assert!(!line.contains('\n'));
        // (serde_json parses floats to within an ulp, not exactly.)
        let back: ClientReport = serde_json::from_str(&line).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(1.0);
        assert!(close(back.first_us, r.first_us));
        assert_eq!(back.later_us.len(), r.later_us.len());
        assert!(back
            .rtt_us
            .iter()
            .zip(&r.rtt_us)
            .all(|(a, b)| close(*a, *b)));
        assert!(close(back.download_mbps.unwrap(), r.download_mbps.unwrap()));
        // First-connection only.
        let r = client(&ClientArgs {
            target,
            later: 0,
            round_trips: 0,
            seconds: 0.0,
        })
        .await
        .unwrap();
        assert!(r.later_us.is_empty() && r.rtt_us.is_empty() && r.upload_mbps.is_none());
    }

    #[test]
    fn ratios_divide_the_pairs_figures() {
        let row = |peer: &'static str, t: f64, mbps: f64| Row {
            peer,
            path: "",
            first_us: summary(&[t]),
            later_us: summary(&[t / 2.0]),
            rtt_us: summary(&[t / 10.0]),
            upload_mbps: summary(&[mbps]),
            download_mbps: summary(&[mbps]),
        };
        let rows = vec![row(DIRECT, 100.0, 1000.0), row(ROAM_RUN, 400.0, 500.0)];
        let r = ratios(&rows);
        assert_eq!(r.len(), PAIRS.len() * CASES.len());
        let get = |a: &str, b: &str, case: &str| {
            r.iter()
                .find(|x| x.roam == a && x.versus == b && x.case == case)
                .unwrap()
                .ratio
        };
        assert_eq!(get(ROAM_RUN, DIRECT, "first connection"), 4.0);
        assert_eq!(get(ROAM_RUN, DIRECT, "later connection"), 4.0);
        assert_eq!(get(ROAM_RUN, DIRECT, "RTT p99"), 4.0);
        assert_eq!(get(ROAM_RUN, DIRECT, "download"), 0.5);
        assert!(get(ROAM_RUN, ROAM_FORWARD, "upload").is_nan());
    }
}
