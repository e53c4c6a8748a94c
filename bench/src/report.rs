//! The report: `results.json` (everything), `results.md` (medians and
//! ratios) and the plots.

use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::peers::{SOCAT_OPTS, SSH_CIPHER};
use crate::procs::version_line;
use crate::scenarios::RatioRow;
use crate::{Outcome, Plan, Scenarios};

/// The machine the numbers come from.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Machine {
    pub(crate) cores: usize,
    pub(crate) cpu_model: String,
    pub(crate) kernel: String,
    pub(crate) os: String,
    pub(crate) mem_total_bytes: u64,
    /// 1-minute load average when the run started (other work on the machine).
    pub(crate) loadavg_start: f64,
    pub(crate) loadavg_end: Option<f64>,
    pub(crate) open_files_limit: u64,
}

fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|t| t.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(f64::NAN)
}

impl Machine {
    pub(crate) fn probe(nofile: u64) -> Machine {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpuinfo = read("/proc/cpuinfo");
        let cpu_model = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split(':').nth(1))
            .map_or_else(|| "unknown".to_string(), |s| s.trim().to_string());
        let os = read("/etc/os-release")
            .lines()
            .find_map(|l| l.strip_prefix("PRETTY_NAME="))
            .map_or_else(|| "unknown".into(), |s| s.trim_matches('"').to_string());
        let mem_total_bytes = read("/proc/meminfo")
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |k| k * 1024);
        Machine {
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            cpu_model,
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            os,
            mem_total_bytes,
            loadavg_start: loadavg(),
            loadavg_end: None,
            open_files_limit: nofile,
        }
    }
}

/// Versions and settings of the programs measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Tools {
    pub(crate) roam: String,
    pub(crate) roam_path: String,
    pub(crate) socat: String,
    pub(crate) socat_options: String,
    pub(crate) ssh: String,
    pub(crate) sshd: String,
    pub(crate) ssh_cipher: &'static str,
}

impl Tools {
    pub(crate) fn probe(roam: &Path) -> Tools {
        let socat = std::process::Command::new("socat")
            .arg("-V")
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .find(|l| l.starts_with("socat version"))
                    .unwrap_or("")
                    .to_string()
            })
            .unwrap_or_else(|e| format!("unavailable ({e})"));
        Tools {
            roam: version_line(&roam.to_string_lossy(), &["--version"]),
            roam_path: roam.display().to_string(),
            socat,
            socat_options: format!(
                "-t 30 TCP-LISTEN:..,fork,reuseaddr,{SOCAT_OPTS} TCP:..,{SOCAT_OPTS}"
            ),
            ssh: version_line("ssh", &["-V"]),
            sshd: roam_sim::sshd::SSHD.to_string(),
            ssh_cipher: SSH_CIPHER,
        }
    }
}

/// One peer as the report describes it.
#[derive(Debug, Serialize)]
pub(crate) struct PeerInfo {
    pub(crate) name: &'static str,
    pub(crate) path: &'static str,
}

/// The whole `results.json`.
#[derive(Debug, Serialize)]
pub(crate) struct Results {
    pub(crate) schema: u32,
    pub(crate) mode: &'static str,
    pub(crate) generated_unix: u64,
    pub(crate) duration_seconds: f64,
    pub(crate) machine: Machine,
    pub(crate) tools: Tools,
    pub(crate) peers: Vec<PeerInfo>,
    pub(crate) plan: Plan,
    pub(crate) scenarios: Scenarios,
    /// The targets against this run's measurements.
    pub(crate) targets: Vec<crate::targets::Target>,
    pub(crate) notes: Vec<String>,
}

impl Results {
    pub(crate) fn new(
        plan: Plan,
        mut machine: Machine,
        tools: Tools,
        scenarios: Scenarios,
    ) -> Results {
        machine.loadavg_end = Some(loadavg());
        let peers = vec![
            PeerInfo {
                name: "direct",
                path: "client -> target (the physical limit)",
            },
            PeerInfo {
                name: "socat",
                path: "client -> socat relay (fork per connection) -> target",
            },
            PeerInfo {
                name: "socat2",
                path: "client -> socat relay -> second socat relay -> target (two hops, compare with roam-forward)",
            },
            PeerInfo {
                name: "ssh-L",
                path: "client -> ssh -N -L -> private sshd -> target",
            },
            PeerInfo {
                name: "roam-forward",
                path: "client -> roam forward -> roam serve -> target",
            },
            PeerInfo {
                name: "roam-pipe",
                path: "client -> roam pipe process (stdin/stdout) -> roam serve -> target",
            },
            PeerInfo {
                name: "roam-session",
                path: "a stream of a roam::connect library session in the harness process -> roam serve -> target (one relay hop, compare with socat)",
            },
        ];
        let notes = vec![
            "Every peer runs on 127.0.0.1 of one machine with other work on it: compare ratios within this run, not absolute numbers across runs.".into(),
            "Peers alternate within every measured cell (order rotated each round); medians over rounds.".into(),
            "Throughput: MB = 10^6 bytes; bulk clients keep Nagle on (no TCP_NODELAY), latency clients set TCP_NODELAY.".into(),
            "Ratios are roam / peer: above 1 is better for roam in throughput, below 1 is better for roam in times.".into(),
            "Hops: socat and roam-session cross one relay process; socat2, ssh-L, roam-forward and roam-pipe cross two. Compare like with like: roam-session/socat, roam-forward/socat2.".into(),
            "CPU s/GB: CPU seconds (utime + stime from /proc/PID/stat) of the peer's own processes per 10^9 bytes moved; the load generator and the target are excluded (the same for every peer). Clock-tick resolution (10 ms): short samples of slow cells are coarse.".into(),
        ];
        let targets = crate::targets::evaluate(&scenarios, plan.many_clients);
        Results {
            schema: 1,
            mode: plan.mode,
            generated_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            duration_seconds: crate::started().elapsed().as_secs_f64(),
            machine,
            tools,
            peers,
            plan,
            scenarios,
            targets,
            notes,
        }
    }
}

/// Writes every output file into `out`; returns their paths.
pub(crate) fn write_all(r: &Results, out: &Path) -> io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let json = out.join("results.json");
    std::fs::write(
        &json,
        serde_json::to_string_pretty(r).map_err(io::Error::other)? + "\n",
    )?;
    files.push(json);
    let plots = crate::plot::all(r, out);
    let md = out.join("results.md");
    std::fs::write(&md, markdown(r, &plots))?;
    files.push(md);
    files.extend(plots.iter().filter_map(|p| p.as_ref().ok().cloned()));
    Ok(files)
}

fn f(v: f64, digits: usize) -> String {
    if v.is_finite() {
        format!("{v:.digits$}")
    } else {
        "–".into()
    }
}

/// A ratio: two decimals, or three significant digits when small.
fn fr(v: f64) -> String {
    if v.is_finite() && v != 0.0 && v.abs() < 0.1 {
        format!("{v:.2e}")
    } else {
        f(v, 2)
    }
}

fn block_label(b: usize) -> String {
    match b {
        b if b >= 1024 && b % 1024 == 0 => format!("{} KiB", b / 1024),
        1000 => "1 KB".into(),
        b => format!("{b} B"),
    }
}

/// The line a section opens with when its scenario erred or was skipped
/// (`None` when it ran); shared with sections written beside their scenario.
pub(crate) fn status_line<T>(o: &Outcome<T>) -> Option<String> {
    match o {
        Outcome::Ok(_) => None,
        Outcome::Error { error } => Some(format!("**Status: error** — {error}\n")),
        Outcome::Skipped { why } => Some(format!("Skipped — {why}\n")),
    }
}

fn ratio_table(s: &mut String, rows: &[RatioRow]) {
    let _ = writeln!(s, "| case | roam | vs | ratio |\n|---|---|---|---:|");
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} |",
            r.case,
            r.roam,
            r.versus,
            fr(r.ratio)
        );
    }
}

fn markdown(r: &Results, plots: &[io::Result<PathBuf>]) -> String {
    let mut s = String::new();
    let m = &r.machine;
    let _ = writeln!(
        s,
        "# roam benchmark results ({} mode)\n\n\
         Machine: {} cores, {}, kernel {}, {}, {:.1} GiB RAM; load average {} at start, {} at end. \
         Run took {:.0} s.\n\n\
         Peers: direct TCP; socat relay (`{}`) and two chained socat relays (socat2); `ssh -L` to a private sshd ({}, cipher `{}`); \
         roam ({}) via `roam forward` and `roam pipe` to `roam serve`, and a library session to `roam serve` (roam-session). All on 127.0.0.1.\n",
        r.mode,
        m.cores,
        m.cpu_model,
        m.kernel,
        m.os,
        m.mem_total_bytes as f64 / (1u64 << 30) as f64,
        f(m.loadavg_start, 2),
        f(m.loadavg_end.unwrap_or(f64::NAN), 2),
        r.duration_seconds,
        r.tools.socat_options,
        r.tools.ssh,
        r.tools.ssh_cipher,
        r.tools.roam,
    );
    for n in &r.notes {
        let _ = writeln!(s, "- {n}");
    }
    for p in plots {
        if let Err(e) = p {
            let _ = writeln!(s, "- A plot could not be drawn: {e}");
        }
    }

    let _ = writeln!(s, "\n## Targets (issues 9 and 10)\n");
    let _ = writeln!(
        s,
        "Measured in this run against the targets the issue sets (ratios of peers measured in the same run). \
         In quick mode the samples are short: read a single miss or hit with care.\n"
    );
    let _ = writeln!(
        s,
        "| target | measured | goal | met | note |\n|---|---:|---|---|---|"
    );
    for t in &r.targets {
        let _ = writeln!(
            s,
            "| {} | {} | {} {} | {} | {} |",
            t.what,
            f(t.measured, 2),
            if t.op == ">=" { "≥" } else { "≤" },
            t.goal,
            match t.met {
                Some(true) => "yes",
                Some(false) => "**no**",
                None => "–",
            },
            t.note
        );
    }

    let sc = &r.scenarios;
    let _ = writeln!(s, "\n## 1. Bulk throughput (MB/s, median)\n");
    if let Some(x) = status_line(&sc.throughput) {
        s += &x;
    }
    if let Some(t) = sc.throughput.ok() {
        let _ = writeln!(
            s,
            "{} round(s) of {:.1} s per cell. ![throughput](throughput.png)\n",
            t.rounds, t.seconds_per_sample
        );
        let peers: Vec<&str> = dedup(t.rows.iter().map(|r| r.peer));
        for dir in crate::scenarios::throughput::DIRECTIONS {
            let _ = writeln!(s, "**{dir}**\n");
            let _ = writeln!(
                s,
                "| block | {} | roam-forward/socat | roam-forward/socat2 | roam-forward/ssh-L | roam-session/socat | roam-pipe-named/roam-pipe |",
                peers.join(" | ")
            );
            let _ = writeln!(
                s,
                "|---|{}---:|---:|---:|---:|---:|",
                "---:|".repeat(peers.len())
            );
            let blocks: Vec<usize> = dedup(t.rows.iter().map(|r| r.block_bytes));
            for b in blocks {
                let get = |p: &str| {
                    t.rows
                        .iter()
                        .find(|r| r.direction == dir && r.block_bytes == b && r.peer == p)
                        .map_or(f64::NAN, |r| r.median_mbps)
                };
                let cells: Vec<String> = peers.iter().map(|p| f(get(p), 2)).collect();
                let ratio = |a: &str, b: &str| f(crate::stats::ratio(get(a), get(b)), 2);
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {} |",
                    block_label(b),
                    cells.join(" | "),
                    ratio("roam-forward", "socat"),
                    ratio("roam-forward", "socat2"),
                    ratio("roam-forward", "ssh-L"),
                    ratio("roam-session", "socat"),
                    ratio("roam-pipe-named", "roam-pipe"),
                );
            }
            s += "\n";
        }
        let _ = writeln!(
            s,
            "**CPU seconds per GB moved** (the peer's own processes; lower is better)\n"
        );
        for dir in crate::scenarios::throughput::DIRECTIONS {
            let _ = writeln!(s, "*{dir}*\n");
            let _ = writeln!(
                s,
                "| block | {} | roam-forward/ssh-L | roam-forward/socat2 | roam-session/socat |",
                peers.join(" | ")
            );
            let _ = writeln!(s, "|---|{}---:|---:|---:|", "---:|".repeat(peers.len()));
            for b in dedup(t.rows.iter().map(|r| r.block_bytes)) {
                let get = |p: &str| {
                    t.rows
                        .iter()
                        .find(|r| r.direction == dir && r.block_bytes == b && r.peer == p)
                        .map_or(f64::NAN, |r| r.cpu_seconds_per_gb)
                };
                let cells: Vec<String> = peers.iter().map(|p| f(get(p), 2)).collect();
                let ratio = |a: &str, b: &str| f(crate::stats::ratio(get(a), get(b)), 2);
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} |",
                    block_label(b),
                    cells.join(" | "),
                    ratio("roam-forward", "ssh-L"),
                    ratio("roam-forward", "socat2"),
                    ratio("roam-session", "socat"),
                );
            }
            s += "\n";
        }
        let _ = writeln!(s, "What each peer's CPU counts:\n");
        for (p, what) in &t.cpu_counted {
            let _ = writeln!(s, "- `{p}`: {what}");
        }
        s += "\n";
    }

    let _ = writeln!(s, "## 2. Request/response latency (µs)\n");
    if let Some(x) = status_line(&sc.latency) {
        s += &x;
    }
    if let Some(l) = sc.latency.ok() {
        let _ = writeln!(
            s,
            "{} round(s) × {} round trips per peer and size. ![latency CDF](latency_cdf.png)\n",
            l.rounds, l.round_trips_per_round
        );
        let _ = writeln!(s, "| size | peer | median | p99 | roam median ratio vs socat / socat2 / ssh-L |\n|---|---|---:|---:|---|");
        for row in &l.rows {
            let rr: Vec<String> = l
                .median_ratios
                .iter()
                .filter(|x| {
                    x.roam == row.peer
                        && x.case == format!("{} B", row.size_bytes)
                        && x.versus != "direct"
                })
                .map(|x| f(x.ratio, 2))
                .collect();
            let _ = writeln!(
                s,
                "| {} B | {} | {} | {} | {} |",
                row.size_bytes,
                row.peer,
                f(row.rtt_us.median, 1),
                f(row.rtt_us.p99, 1),
                rr.join(" / ")
            );
        }
        s += "\n";
    }

    let _ = writeln!(s, "## 3. Set-up time (µs, until a 1-byte echo returns)\n");
    if let Some(x) = status_line(&sc.setup) {
        s += &x;
    }
    if let Some(t) = sc.setup.ok() {
        let _ = writeln!(
            s,
            "| kind | peer | what | median | p90 | n |\n|---|---|---|---:|---:|---:|"
        );
        for row in &t.rows {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} |",
                row.kind,
                row.peer,
                row.what,
                f(row.time_us.median, 0),
                f(row.time_us.p90, 0),
                row.time_us.n
            );
        }
        s += "\n";
        ratio_table(&mut s, &t.ratios);
        s += "\n";
    }

    let _ = writeln!(
        s,
        "## 4. Failure detection and resume vs open streams (ms)\n"
    );
    if let Some(x) = status_line(&sc.resume) {
        s += &x;
    }
    if let Some(t) = sc.resume.ok() {
        let _ = writeln!(
            s,
            "Idle session black-holed by the fault proxy; roam defaults: heartbeat {:.0} ms, suspend after {:.0} ms. \
             Resume times are from the moment connectivity returns. ![resume](resume.png)\n",
            t.heartbeat_interval_ms, t.suspend_after_ms
        );
        let _ = writeln!(s, "| streams | detect (client) | detect (relay) | Resumed event | first echo | echo on every stream | rocks 1.6+0.55n |\n|---:|---:|---:|---:|---:|---:|---:|");
        for row in &t.rows {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} |",
                row.streams,
                f(row.detect_client_ms.median, 0),
                row.detect_relay_ms
                    .as_ref()
                    .map_or("–".into(), |x| f(x.median, 0)),
                f(row.resumed_event_ms.median, 1),
                f(row.first_echo_ms.median, 1),
                f(row.all_streams_echo_ms.median, 1),
                f(row.paper_model_ms, 1),
            );
        }
        let _ = writeln!(
            s,
            "\nFit of time-to-first-echo: {} ms + {} µs per stream (rocks: 1.6 ms + 550 µs per stream); flat in streams: {}.\n",
            f(t.fit_intercept_ms, 2),
            f(t.fit_slope_ms_per_stream * 1000.0, 4),
            t.resume_flat_in_streams
        );
    }

    let _ = writeln!(s, "## 5. Memory per session (KiB of RSS)\n");
    if let Some(x) = status_line(&sc.memory) {
        s += &x;
    }
    if let Some(t) = sc.memory.ok() {
        let _ = writeln!(s, "Relay: {}. Client: {}.\n", t.relay, t.client);
        let _ = writeln!(s, "| sessions | state | relay | relay streams | relay KiB/session | client KiB/session | client heap KiB/session: live / pages / resident | relay RSS MiB | client RSS MiB |\n|---:|---|---|---|---:|---:|---:|---:|---:|");
        for row in &t.rows {
            let h = &row.client_heap_per_session;
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} / {} / {} | {} | {} |",
                row.sessions,
                row.state,
                row.relay,
                row.relay_streams,
                f(row.relay_bytes_per_session / 1024.0, 1),
                f(row.client_bytes_per_session / 1024.0, 1),
                f(h.allocated / 1024.0, 2),
                f(h.active / 1024.0, 2),
                f(h.resident / 1024.0, 2),
                f(row.relay_rss as f64 / 1048576.0, 1),
                f(row.client_rss as f64 / 1048576.0, 1),
            );
        }
        for n in &t.not_measured {
            let _ = writeln!(
                s,
                "| {} | {} | not measured: {} | | | | | | |",
                n.sessions, n.state, n.why
            );
        }
        s += "\n";
        for c in &t.caveats {
            let _ = writeln!(s, "- {c}");
        }
        s += "\n";
    }

    let _ = writeln!(s, "## 6. Many concurrent sessions (MB/s)\n");
    if let Some(x) = status_line(&sc.many) {
        s += &x;
    }
    if let Some(t) = sc.many.ok() {
        let _ = writeln!(
            s,
            "{} clients, {}, target writes {} B blocks; bytes counted at each client during one common {:.1} s window after a {:.1} s warm-up.\n",
            t.clients, t.direction, t.block_bytes, t.window_seconds, t.warmup_seconds
        );
        let _ = writeln!(s, "| peer | one client is a | aggregate | min | median | max | Jain index | clients starved |\n|---|---|---:|---:|---:|---:|---:|---:|");
        for row in &t.rows {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                row.peer,
                row.unit,
                f(row.aggregate_mbps, 1),
                f(row.min_mbps, 3),
                f(row.median_mbps, 3),
                f(row.max_mbps, 3),
                f(row.jain_index, 3),
                f(row.starved, 0)
            );
        }
        s += "\n";
        ratio_table(&mut s, &t.ratios);
        let _ = writeln!(
            s,
            "\nKernel TCP counters during each peer's rounds (increase from before connecting to the end of the window, \
             `/proc/net/netstat` and `/proc/net/snmp` as `nstat` reads them; system-wide, so other work adds to them):\n"
        );
        let names: Vec<&str> = crate::scenarios::many::NET_COUNTERS
            .iter()
            .copied()
            .filter(|k| t.rows.iter().any(|r| r.net_counters.contains_key(*k)))
            .collect();
        let short: Vec<&str> = names
            .iter()
            .map(|k| k.split_once(':').map_or(*k, |x| x.1))
            .collect();
        let _ = writeln!(
            s,
            "| peer | {} |\n|---|{}",
            short.join(" | "),
            "---:|".repeat(short.len())
        );
        for row in &t.rows {
            let cells: Vec<String> = names
                .iter()
                .map(|k| {
                    row.net_counters
                        .get(*k)
                        .map_or("–".into(), |v| v.to_string())
                })
                .collect();
            let _ = writeln!(s, "| {} | {} |", row.peer, cells.join(" | "));
        }
        s += "\n";
    }
    cluster_section(&mut s, &sc.cluster);
    takeover_section(&mut s, &sc.takeover);
    shell_section(&mut s, &sc.shell);
    migrate_section(&mut s, &sc.migrate);
    interpose_section(&mut s, &sc.interpose);
    service_section(&mut s, &sc.service);
    crate::scenarios::isr::section(&mut s, &sc.isr);
    s
}

/// Bytes as powers of two (0, 1 KiB, 64 KiB, 1 MiB, ...).
fn kib_label(b: usize) -> String {
    match b {
        0 => "0".into(),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// Section 12: service continuations (the paper's Table 3 and Fig. 9-10).
fn service_section(s: &mut String, o: &Outcome<crate::scenarios::service::Service>) {
    let _ = writeln!(
        s,
        "\n## 12. Service continuations: primitives and a stream moved every 2 s (roam-service)\n"
    );
    if let Some(x) = status_line(o) {
        *s += &x;
    }
    let Some(t) = o.ok() else {
        return;
    };
    for n in &t.notes {
        let _ = writeln!(s, "- {n}");
    }
    let _ = writeln!(
        s,
        "\nPrimitives, sans-IO in one process (medians). `associate`: {} ns per end (a fresh process with one writer and one reader end). Bytes through a writer end and a reader end (write, send, receive, read, log trimmed by an export every MiB): {} GB/s against {} GB/s for one plain copy of the same 64 KiB chunks (ratio {}).\n",
        f(t.associate_ns, 0),
        f(t.ends_gb_per_s, 2),
        f(t.memcpy_gb_per_s, 2),
        fr(t.ends_ratio)
    );
    let _ = writeln!(
        s,
        "| snapshot | eager export (`export`, copies) µs | lazy export (`export_owned`, swaps) µs | eager / lazy |\n|---:|---:|---:|---:|"
    );
    for r in &t.exports {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} |",
            kib_label(r.snapshot_bytes),
            f(r.eager_ns / 1e3, 3),
            f(r.lazy_ns / 1e3, 3),
            f(r.ratio, 1)
        );
    }
    let _ = writeln!(
        s,
        "\nA move's sans-IO work against the bytes the consumer read since its last export (µs):\n\n| logged | cut encoded | `Cut::of` | `encode` | `decode` | `resume` | total |\n|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in &t.cuts {
        let _ = writeln!(
            s,
            "| {} | {} B | {} | {} | {} | {} | {} |",
            kib_label(r.logged_bytes),
            r.encoded_bytes,
            f(r.of_us, 1),
            f(r.encode_us, 1),
            f(r.decode_us, 1),
            f(r.resume_us, 1),
            f(r.total_us, 1)
        );
    }
    let _ = writeln!(
        s,
        "\nStream (TTCP-like, two members over a Unix socket, every byte checked; stall: from the move's end until the consumer checks a new byte):\n\n| moves | producer exports | consumer exports every | seconds | MB checked | MB/s | moves made | move ms (freeze to thaw) | cut bytes per move | stream GB at each move | stall ms after each move |\n|---|---|---:|---:|---:|---:|---:|---|---|---|---|"
    );
    for r in &t.stream {
        let list = |v: Vec<String>| {
            if v.is_empty() {
                "–".to_string()
            } else {
                v.join(", ")
            }
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.move_every_s
                .map_or("none".into(), |e| format!("every {e} s")),
            if r.producer_exports {
                format!(
                    "{} every {}, {} B state, {} ns each",
                    r.export.as_str(),
                    kib_label(r.producer_chunk),
                    r.state_bytes,
                    f(r.export_ns, 0)
                )
            } else {
                "never (Fig. 10)".to_string()
            },
            kib_label(r.consumer_export_bytes),
            f(r.seconds, 1),
            f(r.bytes as f64 / 1e6, 0),
            f(r.mb_per_s, 1),
            r.moves,
            list(r.move_ms.iter().map(|x| format!("{x:.1}")).collect()),
            list(r.cut_bytes.iter().map(|x| x.to_string()).collect()),
            list(
                r.position_at_move
                    .iter()
                    .map(|x| format!("{:.1}", *x as f64 / 1e9))
                    .collect()
            ),
            list(r.stall_ms.iter().map(|x| format!("{x:.1}")).collect())
        );
    }
    let _ = writeln!(
        s,
        "\nThroughput with moves every 2 s / without: **{}** (median MB/s of each). Fig. 10, a producer that never exports / one that exports every chunk, both moved every 2 s: **{}**. Moves: p50 {} ms, max {} ms over {}.",
        f(t.stream_ratio, 3),
        f(t.never_exporting_ratio, 3),
        f(t.move_ms.median, 1),
        f(t.move_ms.max, 1),
        t.move_ms.n
    );
    let _ = writeln!(
        s,
        "\nEager against lazy export in the running stream (the producer exports a 10 KiB snapshot after every 8 KiB, the consumer every 8 KiB): lazy / eager MB/s **{}** without moves, **{}** with moves every 0.5 s (medians). The producer's export call (the position and every channel's position recorded, released output sent): eager {} ns, lazy {} ns. Moves: eager p50 {} ms (max {}, n {}), lazy p50 {} ms (max {}, n {}).",
        f(t.lazy_eager_still, 3),
        f(t.lazy_eager_moving, 3),
        f(t.eager_export_ns, 0),
        f(t.lazy_export_ns, 0),
        f(t.eager_move_ms.median, 1),
        f(t.eager_move_ms.max, 1),
        t.eager_move_ms.n,
        f(t.lazy_move_ms.median, 1),
        f(t.lazy_move_ms.max, 1),
        t.lazy_move_ms.n
    );
}

/// Section 11: an unmodified program under `roam run` against plain TCP
/// and `roam forward`, between two network namespaces.
fn interpose_section(s: &mut String, o: &Outcome<crate::scenarios::interpose::Interpose>) {
    use crate::scenarios::interpose::{CASES, PAIRS};
    let _ = writeln!(
        s,
        "\n## 11. An unmodified program under `roam run` (interposition) vs plain TCP and `roam forward`\n"
    );
    if let Some(x) = status_line(o) {
        *s += &x;
    }
    let Some(t) = o.ok() else {
        return;
    };
    let first_n = t.rows.first().map_or(0, |r| r.first_us.n);
    let _ = writeln!(
        s,
        "Two network namespaces on one bridge: a client host and a server host, which runs the \
         target ({}) and `roam serve` on its relay port. One client program (the harness's load \
         generator) on the client host, run four ways, alternating in each of {} round(s): \
         `direct` (plain TCP to the target's address), `roam-run` (`roam run -- client`, same \
         address: the agent probes the host, finds the relay and carries each connection as a \
         stream of one session), `roam-run-ordinary` (the same with `--relay-port` closed: the \
         probe is refused and the agent carries plain TCP) and `roam-forward` (to `roam forward` \
         on the client host's 127.0.0.1, its session made before the rounds). *First connection*: \
         a fresh process's first connect until a 1-byte echo returns ({} per way; for `roam-run` \
         the probe, the Noise handshake and the stream; for `roam-forward` a new stream of its \
         running session). *Later connection*: the same for each of a process's next {} \
         connections. RTT: {} 1-byte ping-pongs per process after {} of warm-up (TCP_NODELAY). \
         Throughput: one upload and one download of {:.1} s per process in {} KiB writes, every \
         byte checked. Ratios are of medians (p99 for RTT p99): below 1 is better for the first \
         named in times, above 1 in MB/s.\n",
        t.target,
        t.rounds,
        first_n,
        t.later_per_process,
        t.round_trips_per_process,
        t.warmup_round_trips,
        t.seconds_per_transfer,
        t.block_bytes / 1024
    );
    let _ = writeln!(
        s,
        "| peer | first connection (ms) | later connection (ms) | RTT p50 (µs) | RTT p99 (µs) | upload (MB/s) | download (MB/s) |\n|---|---:|---:|---:|---:|---:|---:|"
    );
    for r in &t.rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.peer,
            f(r.first_us.median / 1e3, 2),
            f(r.later_us.median / 1e3, 3),
            f(r.rtt_us.median, 0),
            f(r.rtt_us.p99, 0),
            f(r.upload_mbps.median, 0),
            f(r.download_mbps.median, 0)
        );
    }
    let _ = writeln!(
        s,
        "\n| ratio | {} |\n|---|{}",
        CASES.join(" | "),
        "---:|".repeat(CASES.len())
    );
    for (a, b) in PAIRS {
        let cells: Vec<String> = CASES
            .iter()
            .map(|c| {
                t.ratios
                    .iter()
                    .find(|x| x.roam == a && x.versus == b && x.case == *c)
                    .map_or_else(|| "–".to_string(), |x| fr(x.ratio))
            })
            .collect();
        let _ = writeln!(s, "| {a} / {b} | {} |", cells.join(" | "));
    }
    let _ = writeln!(s, "\nPaths:\n");
    for r in &t.rows {
        let _ = writeln!(s, "- `{}`: {}", r.peer, r.path);
    }
}

/// Section 10: a process moved to another host (CRIU, `roam migrate-process`).
fn migrate_section(s: &mut String, o: &Outcome<crate::scenarios::migrate::Migrate>) {
    let _ = writeln!(
        s,
        "\n## 10. A running process moved to another host (CRIU; roam migrate-process)\n"
    );
    if let Some(x) = status_line(o) {
        *s += &x;
    }
    let Some(m) = o.ok() else {
        return;
    };
    let _ = writeln!(
        s,
        "Three network namespaces on one bridge: a client host, host A and host B. A Python \
         server on A holds the memory shown and echoes on every connection from the client host; \
         it moves to B with its connections and its service address, four ways per case: \
         `criu (reference)` drives {} directly (dump on A, images in a local directory, the \
         address moved, restore on B, the client host's neighbour entry forgotten; roam's \
         address lock on both sides); `roam migrate-process` runs the command on A against \
         `roam migrate-accept` on B (images over an encrypted roam session, the address moved \
         and announced with a gratuitous ARP, the packets that reached A during the freeze \
         re-injected at B); `roam --no-reinject` is the command without the re-injection; \
         `roam --lazy-pages` is post-copy (the images travel without the server's private \
         memory, which follows over the session once the server runs at B: column \
         \"after (MB)\"; B's migrate-accept in a pid namespace of its own). \
         Moved: from the move's start until the address answers on B (roam: the command's wall \
         time). Freeze: the longest 1-byte round trip of a probe connection across the move, as \
         the client sees it (without re-injection it includes the client's TCP retransmission \
         timeout). Without --lazy-pages the memory is copied inside the freeze. Targets (1 GB, \
         1,000 connections, `roam migrate-process`, full runs): freeze ≤ {} ms (the paper), goal \
         ≤ {} ms.\n",
        m.criu,
        crate::scenarios::migrate::PAPER_FREEZE_MS,
        crate::scenarios::migrate::GOAL_FREEZE_MS
    );
    let _ = writeln!(
        s,
        "| connections | memory (MB) | mover | dump (ms) | transfer (ms) | restore (ms) | moved (ms) | freeze (ms) | re-injected | probe RTT before (ms) | images (MB) | after (MB) | intact |\n|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in &m.rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} of {} |",
            r.connections,
            r.memory_mb,
            r.mover.label(),
            f(r.dump_ms, 0),
            r.transfer_ms.map_or_else(|| "–".to_string(), |t| f(t, 0)),
            f(r.restore_ms, 0),
            f(r.moved_ms, 0),
            f(r.freeze_ms, 0),
            r.reinjected
                .map_or_else(|| "–".to_string(), |n| n.to_string()),
            f(r.probe_rtt_ms, 2),
            f(r.image_bytes as f64 / 1e6, 1),
            r.followed_mb.map_or_else(|| "–".to_string(), |m| f(m, 1)),
            r.intact,
            r.connections
        );
    }
}

/// Section 9: interactive shells (`roam shell` against ssh and mosh).
fn shell_section(s: &mut String, o: &Outcome<crate::scenarios::shell::ShellBench>) {
    let _ = writeln!(s, "\n## 9. Interactive shells (`roam shell`, ssh, mosh)\n");
    if let Some(x) = status_line(o) {
        *s += &x;
    }
    let Some(t) = o.ok() else {
        return;
    };
    let _ = writeln!(
        s,
        "Each client on a pseudo-terminal this benchmark reads, on loopback. Echo: one keystroke \
         until the terminal shows it ({} keystrokes). Re-attach ({} rounds): the shell prints {} \
         lines starting 1 s after its client was killed with -9; a new client process is \
         started, and timed until the last line is on its terminal; kept: how many of the lines \
         printed while nobody watched reached the new terminal (worst round).\n",
        t.keystrokes, t.reattach_rounds, t.lines
    );
    let _ = writeln!(
        s,
        "| client | echo p50 (µs) | echo p99 (µs) | re-attach p50 (ms) | re-attach max (ms) | lines kept | note |\n|---|---:|---:|---:|---:|---:|---|"
    );
    let dash = || "–".to_string();
    for r in &t.rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.peer,
            r.echo_us.as_ref().map_or_else(dash, |e| f(e.median, 0)),
            r.echo_us.as_ref().map_or_else(dash, |e| f(e.p99, 0)),
            r.reattach_ms.as_ref().map_or_else(dash, |e| f(e.median, 1)),
            r.reattach_ms.as_ref().map_or_else(dash, |e| f(e.max, 1)),
            r.lines_kept
                .map_or_else(dash, |k| format!("{k} of {}", t.lines)),
            r.note.as_deref().unwrap_or("")
        );
    }
    if let Some(p) = &t.parked {
        let _ = writeln!(
            s,
            "\nParked shells: {} `roam shell` clients each started a shell and detached (`~.`); \
             the relay then holds each shell with no client, session or socket. Per parked \
             shell, in the relay: {:.1} KiB of RSS and {:.1} descriptors; threads added in all: \
             {}; sockets added: {}. One task per shell. The shell process itself: {:.0} KiB RSS \
             (median).",
            p.shells,
            p.rss_kib_per_shell,
            p.fds_per_shell,
            p.threads_added,
            p.sockets_added,
            p.shell_rss_kib
        );
    }
}

/// Section 8: relay upgrades (`roam serve --takeover`).
fn takeover_section(s: &mut String, o: &Outcome<crate::scenarios::takeover::Takeover>) {
    let _ = writeln!(
        s,
        "\n## 8. Relay upgrade without loss (`roam serve --takeover`)\n"
    );
    if let Some(x) = status_line(o) {
        *s += &x;
    }
    let Some(t) = o.ok() else {
        return;
    };
    let _ = writeln!(
        s,
        "Each session has one stream to the echo target; client connections move with their \
         sessions, in waves while the others keep running. Stall: when the old relay announces the \
         handover, every client writes one byte; the time until its echo is back, over every \
         session and round. Stopped: the new relay's report per round (p50 / p99 / max) of how \
         long each session was stopped, from the old relay stopping it to the new one running it \
         (both on the host's monotonic clock). Resumed: sessions \
         whose client saw `Suspended` (its connection did not move). Handover: the old relay's \
         own time from the takeover's start to the new relay's receipt. Target: a stall of at \
         most {} ms at 1,000 sessions (the p99 stall and every round's p99 stop){}.\n",
        t.target_ms,
        match t.target_met_at_1000 {
            Some(true) => " (met: p99 within it)",
            Some(false) => " (missed: p99 above it)",
            None => "",
        }
    );
    let _ = writeln!(
        s,
        "| sessions | rounds | stall p50 (ms) | p99 | max | same burst without takeover p50 / p99 | stopped p50 / p99 / max per round (ms) | resumed | handover (old relay) | of which taking out / sending | every byte back after | echo failures |\n|---:|---:|---:|---:|---:|---|---|---:|---|---|---|---:|"
    );
    for r in &t.rows {
        let list = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            s,
            "| {}{} | {} | {} | {} | {} | {} / {} | {} | {} | {} ms | {} / {} ms | {} ms | {} |",
            r.sessions,
            r.requested.map_or(String::new(), |n| format!(
                " (of {n} asked: the open-file limit)"
            )),
            r.rounds,
            f(r.stall_ms.median, 2),
            f(r.stall_ms.p99, 2),
            f(r.stall_ms.max, 2),
            f(r.burst_ms.median, 2),
            f(r.burst_ms.p99, 2),
            r.stopped_p50_ms
                .iter()
                .zip(&r.stopped_p99_ms)
                .zip(&r.stopped_max_ms)
                .map(|((a, b), c)| format!("{a:.1} / {b:.1} / {c:.1}"))
                .collect::<Vec<_>>()
                .join("; "),
            r.resumed,
            list(&r.handover_ms),
            list(&r.taking_out_ms),
            list(&r.sending_ms),
            list(&r.all_served_ms),
            r.echo_failures
        );
    }
}

/// Bytes as the issue names state sizes (0, 1 KB, ..., 10 MB).
fn size_label(b: usize) -> String {
    match b {
        0 => "0".into(),
        b if b >= 1_000_000 && b % 1_000_000 == 0 => format!("{} MB", b / 1_000_000),
        b if b >= 1000 && b % 1000 == 0 => format!("{} KB", b / 1000),
        b => format!("{b} B"),
    }
}

/// Section 7: moves between cluster hosts, with the targets.
fn cluster_section(s: &mut String, o: &Outcome<crate::scenarios::cluster::Cluster>) {
    let _ = writeln!(s, "## 7. Moving live sessions between cluster hosts\n");
    if let Some(x) = status_line(o) {
        *s += &x;
    }
    let Some(t) = o.ok() else {
        return;
    };
    for n in &t.notes {
        let _ = writeln!(s, "- {n}");
    }
    let _ = writeln!(
        s,
        "\nClient-visible stall and move time vs state size (ms, median over {} moves; max in parentheses). \
         Frozen and whole move are the source host's `MoveReport`. ![cluster](cluster.png)\n",
        t.stall.first().map_or(0, |r| r.moves)
    );
    let _ = writeln!(
        s,
        "| state | pre-copy | stall (client) | round trip otherwise | frozen | whole move | pre-copied B | transfer B |\n|---:|---|---:|---:|---:|---:|---:|---:|"
    );
    for r in &t.stall {
        if let Some(why) = &r.refused {
            let _ = writeln!(
                s,
                "| {} | {} | refused: {why} | | | | | |",
                size_label(r.state_bytes),
                if r.precopy { "yes" } else { "no" }
            );
            continue;
        }
        let med = |x: &Option<crate::stats::Summary>| x.as_ref().map_or(f64::NAN, |v| v.median);
        let _ = writeln!(
            s,
            "| {} | {} | {} ({}) | {} | {} | {} | {} | {} |",
            size_label(r.state_bytes),
            if r.precopy { "yes" } else { "no" },
            f(med(&r.stall_ms), 2),
            f(r.stall_ms.as_ref().map_or(f64::NAN, |v| v.max), 2),
            f(r.baseline_rtt_ms.unwrap_or(f64::NAN), 3),
            f(med(&r.frozen_ms), 2),
            f(med(&r.total_ms), 2),
            r.precopy_bytes.map_or("–".into(), |b| b.to_string()),
            f(r.transfer_bytes.unwrap_or(f64::NAN), 0),
        );
    }
    let _ = writeln!(
        s,
        "\nDrain (ms from the `drain()` call){}:\n",
        if t.drain_note.is_empty() {
            String::new()
        } else {
            format!("; {}", t.drain_note)
        }
    );
    let _ = writeln!(
        s,
        "| sessions | links reused | moved | drain() returned | every client Resumed | every client echoed | sessions per host |\n|---:|---|---:|---:|---:|---:|---|"
    );
    for r in &t.drain {
        let hosts: Vec<String> = r
            .per_host
            .iter()
            .map(|(h, n)| format!("{h}: {n}"))
            .collect();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.sessions,
            if r.reuse_links { "yes" } else { "no" },
            r.moved,
            f(r.drain_ms, 1),
            f(r.all_resumed_ms, 1),
            f(r.all_echoed_ms, 1),
            hosts.join(", ")
        );
    }
    let _ = writeln!(
        s,
        "\nThroughput of a download with periodic moves ({} round(s), median):\n",
        t.throughput_rounds
    );
    let _ = writeln!(
        s,
        "| move every | seconds per download | MB per download | MB/s | moves | loss vs no moves | stall per move (client, ms) | moves' stalls, share of time |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in &t.throughput {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            r.move_every_s.map_or("never".into(), |e| format!("{e} s")),
            f(r.seconds, 1),
            f(r.median_bytes / 1e6, 0),
            f(r.median_mbps, 1),
            r.moves,
            if r.move_every_s.is_some() {
                format!("{} %", f(r.loss_pct, 2))
            } else {
                "–".into()
            },
            f(r.median_stall_ms, 1),
            if r.move_every_s.is_some() {
                format!("{} %", f(r.stalled_pct, 2))
            } else {
                "–".into()
            }
        );
    }
    *s += "\n";
}

/// Distinct values in first-seen order.
fn dedup<T: PartialEq + Copy>(it: impl Iterator<Item = T>) -> Vec<T> {
    let mut v: Vec<T> = Vec::new();
    for x in it {
        if !v.contains(&x) {
            v.push(x);
        }
    }
    v
}
