//! Scenario 13: suspend here, resume there (issue 14, Internet
//! Suspend/Resume; the paper's tables of resume latency, slowdown and
//! lookaside savings).
//!
//! Two network namespaces joined by a veth (roam-sim's `NetPair`, removed
//! with everything in it when the scenario ends, also on failure or panic):
//! the server host runs an S3-compatible store (`s3s-fs`) on a free port of
//! its veth address; the client host runs every QEMU guest and every `roam`
//! command, so all store traffic crosses the veth and nothing else is sent.
//! The guest is the one `crates/roam-cli/tests/vm_isr.rs` runs
//! (`scripts/guest-build`: 128 MiB of memory, a 64 MiB ext2 disk, a counter
//! in memory ticking once a second and printing `roam-guest: tick N ...` on
//! its serial console after appending to and checking a file on its disk).
//!
//! Set-up, on the veth without a rate limit: boot the guest at site A, `roam
//! suspend --vm` it (version 1, timed), write version 1's images as plain
//! files into a directory (the *stale* lookaside cache), resume version 1
//! at site B1, let it tick twice and suspend it again (version 2: the
//! second suspend's chunks uploaded show the dedup), and write version 2's
//! images into another directory (the *fresh* lookaside cache). The resume
//! site also hoards (`roam hoard`, ISR's fully proactive hoarding) version
//! 1 after the first suspend and version 2 after the second, over the
//! version 1 hoard (only its new chunks fetched); both hoards are timed.
//!
//! Then for every link rate (`tbf` on both ends of the veth), in rounds
//! (the plan's count per rate; the policies' order rotated each round),
//! version 2 is resumed into a fresh directory five ways: copy everything in first
//! (`roam resume --vm`), demand fetch (`--demand-fetch`: QEMU starts once
//! the memory image is in and the disk comes over NBD), copy-in with
//! the fresh and with the stale lookaside cache (`--lookaside`), and
//! copy-in from the hoard (`--lookaside` the hoard directory). Measured:
//! from the command's start until roam says the guest runs, and until the
//! guest's first tick on its console (its first interaction), the guest's
//! next two ticks (post-resume slowdown: their interval against the 2 s the
//! guest sleeps), bytes received on the client's veth during the resume,
//! and roam's own lookaside counts. The first tick also holds what was left
//! of the guest's 1 s sleep when it was suspended; the suspend is started
//! ~0.85 s after a tick so that this rest is small, and it is reported.
//! Rows are medians over the rounds; every sample is in results.json.
//!
//! Last, per link rate, two more suspends over the limited link: the newest
//! version resumed by demand fetch, three ticks (each appends to the disk),
//! the guest paused over QMP (the user walks away), and 3 s later `roam
//! suspend --vm`: once without and once with `--trickle` at the link's rate
//! (trickle write-back): the time, the disk chunks the suspend still
//! uploaded and the chunks it found written back ahead.
//!
//! Needs root (namespaces, tc), QEMU, the guest (`$ROAM_GUEST` or
//! `/var/cache/roam/guest-*`) and s3s-fs (`$ROAM_S3S_FS` or
//! `/var/cache/roam/s3s-fs-*/bin/s3s-fs`); skipped with the reason otherwise.

use std::io::{self, BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use roam_sim::netns::{self, ChildGuard, NetPair, Side};
use serde::Serialize;

use super::progress;
use crate::peers::Lab;
use crate::Ctx;

/// The store's access key (s3s-fs checks signatures with it).
const ACCESS_KEY: &str = "roam-bench";
/// The store's secret key.
const SECRET_KEY: &str = "roam-bench-secret-key";
/// The bucket: the whole bucket is the store.
const BUCKET: &str = "roam";
/// The environment's name in the store.
const ENV: &str = "lab";
/// The environment of the same guest run with lazy memory (RAM a shared
/// file, stored as vm-ram and vm-devstate).
const ENV_LAZY: &str = "lab-lazy";
/// Where the cached guest and s3s-fs are by default (scripts/*-build).
const CACHE: &str = "/var/cache/roam";
/// Longest the guest may take to boot to its third tick (TCG, shared CPU).
const BOOT_TIMEOUT: Duration = Duration::from_secs(90);
/// Longest a command or a tick may take beyond the transfer's own time.
const SLACK: Duration = Duration::from_secs(60);
/// Bytes a resume may move at most (version 2 is ~25 MB of objects), for
/// the time-outs at slow rates.
const MAX_RESUME_BYTES: f64 = 40e6;
/// How long after a tick the second suspend starts (ms): the guest then has
/// little of its 1 s sleep left, so the first tick after a resume comes
/// soon after the guest runs.
const SUSPEND_AFTER_TICK_MS: u64 = 850;
/// The guest sleeps this long between ticks (ms).
const TICK_MS: f64 = 1000.0;

/// The ways version 2 is resumed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Policy {
    /// `roam resume --vm`: every image copied in before QEMU starts.
    CopyIn,
    /// `roam resume --vm --demand-fetch`: the disk over NBD as touched.
    DemandFetch,
    /// Copy-in with `--lookaside` the exact images of version 2.
    LookasideFresh,
    /// Copy-in with `--lookaside` the images of version 1.
    LookasideStale,
    /// Copy-in with `--lookaside` a hoard (`roam hoard`) made at the
    /// resume site of version 1 and kept current to version 2 ahead of
    /// the resume (ISR's fully proactive hoarding).
    Hoarded,
    /// `roam resume --vm --demand-fetch` of the same guest run with lazy
    /// memory (RAM a shared file): its RAM a FUSE file fetched as touched,
    /// only the device state copied in first (environment [`ENV_LAZY`]).
    LazyMemory,
}

impl Policy {
    /// Every policy, in the order each rate runs them.
    const ALL: [Policy; 6] = [
        Policy::CopyIn,
        Policy::DemandFetch,
        Policy::LookasideFresh,
        Policy::LookasideStale,
        Policy::Hoarded,
        Policy::LazyMemory,
    ];

    /// The row label of the report.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Policy::CopyIn => "copy-in",
            Policy::DemandFetch => "demand fetch",
            Policy::LookasideFresh => "copy-in, fresh lookaside",
            Policy::LookasideStale => "copy-in, stale lookaside",
            Policy::Hoarded => "copy-in, hoarded (`roam hoard`)",
            Policy::LazyMemory => "demand fetch, lazy memory (RAM over FUSE)",
        }
    }
}

/// One `roam suspend --vm`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct SuspendRow {
    /// Which suspend: "first" (everything new), "second" (two ticks
    /// later), after a run of three ticks ("run", "trickled run"), or
    /// "lazy memory" (the first of the lazy-memory environment).
    pub(crate) which: &'static str,
    /// The veth's rate limit during the suspend (Mbit/s), `None` unlimited.
    pub(crate) rate_mbit: Option<u32>,
    /// Disk chunks uploaded (roam's progress line for disk.img).
    pub(crate) disk_chunks_uploaded: u64,
    /// Chunks the suspend found written back ahead by `roam resume
    /// --trickle` (its summary's trickle line), if it said.
    pub(crate) trickled_ahead: Option<u64>,
    /// The command's wall time (s).
    pub(crate) seconds: f64,
    /// Chunks of the version (memory and disk).
    pub(crate) chunks_total: u64,
    /// Chunks uploaded (not already in the store).
    pub(crate) chunks_uploaded: u64,
    /// Bytes of the images read.
    pub(crate) bytes_read: u64,
    /// Bytes uploaded (compressed, encrypted objects).
    pub(crate) bytes_uploaded: u64,
    /// Bytes the client's veth sent during the suspend (with HTTP).
    pub(crate) wire_bytes_sent: u64,
}

/// One `roam hoard` at the resume site, ahead of the resumes.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct HoardRow {
    /// The version hoarded (1 into an empty hoard, 2 over version 1).
    pub(crate) version: u64,
    /// The command's wall time (s).
    pub(crate) seconds: f64,
    /// Chunks of the version.
    pub(crate) chunks_total: u64,
    /// Chunks fetched from the store (not already in the hoard).
    pub(crate) chunks_fetched: u64,
    /// Object bytes the store sent for them (roam's count).
    pub(crate) object_bytes_fetched: u64,
    /// Bytes received on the client's veth during the hoard.
    pub(crate) wire_bytes: u64,
}

/// One measured resume of version 2.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ResumeRow {
    /// The link rate (Mbit/s) on both ends of the veth.
    pub(crate) rate_mbit: u32,
    /// How the environment came in.
    pub(crate) policy: Policy,
    /// Command start until roam said the guest runs (s), if it said so.
    pub(crate) guest_runs_s: Option<f64>,
    /// Command start until the guest's first tick on its console (s).
    pub(crate) first_tick_s: f64,
    /// The interval from the first tick to the third (s; 2.0 plus the
    /// ticks' own work when nothing slows the guest).
    pub(crate) two_ticks_s: f64,
    /// Demand fetch: command start until the background fill was done (s).
    pub(crate) fill_done_s: Option<f64>,
    /// Bytes received on the client's veth during the resume (the fill's
    /// too for demand fetch).
    pub(crate) wire_bytes: u64,
    /// Lookaside: plaintext bytes taken locally (roam's count).
    pub(crate) lookaside_bytes: Option<u64>,
    /// Lookaside: plaintext bytes fetched from the store (roam's count).
    pub(crate) fetched_bytes: Option<u64>,
    /// Lookaside: 1 - wire bytes / the copy-in's wire bytes at this rate
    /// (%; of medians in a row, set when the rows are made).
    pub(crate) wire_saved_pct: Option<f64>,
    /// Samples this row is the median of (1 for a sample).
    pub(crate) n: usize,
}

/// One goal of the issue against this run.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Goal {
    /// What is promised.
    pub(crate) goal: &'static str,
    /// What was measured, in words with the number.
    pub(crate) measured: String,
    /// Whether the measurement meets it.
    pub(crate) met: bool,
}

/// Scenario 13's results.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Isr {
    /// What the figures mean and how they were taken.
    pub(crate) notes: Vec<String>,
    /// The memory image's bytes (version 1).
    pub(crate) memory_bytes: u64,
    /// The disk image's bytes.
    pub(crate) disk_bytes: u64,
    /// Both suspends.
    pub(crate) suspends: Vec<SuspendRow>,
    /// The two hoards at the resume site (after each suspend).
    pub(crate) hoards: Vec<HoardRow>,
    /// What was left of the guest's sleep when version 2 was suspended
    /// (ms, estimated from when its last tick was seen): part of every
    /// first-tick time below.
    pub(crate) residual_sleep_ms: f64,
    /// Medians per link rate and policy.
    pub(crate) resumes: Vec<ResumeRow>,
    /// Every measured resume, in the order run.
    pub(crate) samples: Vec<ResumeRow>,
    /// The goals.
    pub(crate) goals: Vec<Goal>,
}

/// Set when the scenario's future is dropped before its blocking work
/// ended (its budget ran out): every wait of that work then fails, so it
/// unwinds and its guards remove the namespaces, processes and files.
static CANCELLED: AtomicBool = AtomicBool::new(false);

/// Sets [`CANCELLED`] when dropped.
struct CancelOnDrop;

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        CANCELLED.store(true, Ordering::Relaxed);
    }
}

/// An error if the scenario was cancelled (checked in every wait loop).
fn check_cancelled() -> io::Result<()> {
    if CANCELLED.load(Ordering::Relaxed) {
        Err(io::Error::other("cancelled: the scenario's budget ran out"))
    } else {
        Ok(())
    }
}

/// Runs the scenario (blocking work on a thread of its own).
pub(crate) async fn run(ctx: Arc<Ctx>, _lab: Arc<Lab>) -> io::Result<Isr> {
    CANCELLED.store(false, Ordering::Relaxed);
    let _cancel = CancelOnDrop;
    let rates = ctx.plan.isr_links.clone();
    let roam = ctx.env.roam.clone();
    let scratch = ctx.env.dir.clone();
    tokio::task::spawn_blocking(move || {
        let tools = Tools::find(roam)?;
        let tmp = tempfile::Builder::new()
            .prefix("isr-")
            .tempdir_in(&scratch)?;
        measure(&tools, tmp.path(), &rates)
    })
    .await
    .map_err(io::Error::other)?
}

/// What the scenario runs, each found or the reason it is missing.
struct Tools {
    /// The `roam` binary under test.
    roam: PathBuf,
    /// The guest's directory (vmlinuz, initrd.gz, disk.img).
    guest: PathBuf,
    /// The s3s-fs binary.
    s3s: PathBuf,
}

impl Tools {
    /// Finds every tool, or returns `Unsupported` naming what is missing.
    fn find(roam: PathBuf) -> io::Result<Tools> {
        let skip = |why: String| io::Error::new(io::ErrorKind::Unsupported, why);
        netns::available().map_err(skip)?;
        for tool in ["qemu-system-x86_64", "tc"] {
            if !netns::installed(tool) {
                return Err(skip(format!(
                    "{tool} is not installed (apt-get install qemu-system-x86 iproute2)"
                )));
            }
        }
        let guest = env_or_cache("ROAM_GUEST", "guest-", "")
            .filter(|g| {
                ["vmlinuz", "initrd.gz", "disk.img"]
                    .iter()
                    .all(|f| g.join(f).is_file())
            })
            .ok_or_else(|| skip("no QEMU guest: set ROAM_GUEST=$(scripts/guest-build)".into()))?;
        let s3s = env_or_cache("ROAM_S3S_FS", "s3s-fs-", "bin/s3s-fs")
            .filter(|p| p.is_file())
            .ok_or_else(|| skip("no s3s-fs: set ROAM_S3S_FS=$(scripts/s3s-build)".into()))?;
        Ok(Tools { roam, guest, s3s })
    }
}

/// `$var` if set, else the newest `CACHE/<prefix>*/<tail>`.
fn env_or_cache(var: &str, prefix: &str, tail: &str) -> Option<PathBuf> {
    if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(v));
    }
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(CACHE)
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .filter(|e| !e.file_name().to_string_lossy().ends_with(".tmp"))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path().join(tail))))
        .collect();
    found.sort();
    found.pop().map(|(_, p)| p)
}

/// The two hosts, the store on one of them.
struct Net {
    /// The namespaces (dropped last: kills whatever is left in them).
    pair: NetPair,
    /// The store's URL as the client host reaches it.
    endpoint: String,
    /// The s3s-fs process (killed when dropped).
    _s3s: ChildGuard,
}

impl Net {
    /// Makes the namespaces and starts s3s-fs on a free port of the server
    /// host's address, its data under `dir`.
    fn start(tools: &Tools, dir: &Path) -> io::Result<Net> {
        let pair = NetPair::new("isr")?;
        let root = dir.join("s3");
        std::fs::create_dir_all(root.join(BUCKET))?;
        let host = pair.server_addr();
        for _attempt in 0..5 {
            let port = pair.in_ns(Side::Server, || {
                TcpListener::bind((host, 0)).and_then(|l| l.local_addr())
            })??;
            let port = port.port();
            let mut cmd = pair.command(Side::Server, &tools.s3s);
            cmd.args(["--host", &host.to_string(), "--port", &port.to_string()])
                .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
                .arg(&root)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let mut s3s = ChildGuard::spawn(&mut cmd)?;
            let addr = SocketAddr::from((host, port));
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && s3s.try_wait()?.is_none() {
                if pair
                    .tcp_connect(Side::Client, addr, Duration::from_millis(200))
                    .is_ok()
                {
                    return Ok(Net {
                        pair,
                        endpoint: format!("http://{addr}"),
                        _s3s: s3s,
                    });
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Err(io::Error::other(format!(
            "{} did not start listening on {host}",
            tools.s3s.display()
        )))
    }

    /// `roam` in the client host, with the store's settings and its own
    /// state directory under `dir`.
    fn roam(&self, tools: &Tools, dir: &Path) -> Command {
        let mut c = self.pair.command(Side::Client, &tools.roam);
        c.env("ROAM_STATE_DIR", dir.join("state"))
            .env("XDG_CONFIG_HOME", dir.join("no-config"))
            .env("ROAM_S3_ENDPOINT", &self.endpoint)
            .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
            .env_remove("ROAM_S3_REGION");
        c
    }

    /// Puts `tbf` at `mbit` Mbit/s on both ends of the veth (replacing any).
    fn rate(&self, mbit: u32) -> io::Result<()> {
        for side in [Side::Client, Side::Server] {
            let mut c = self.pair.command(side, "tc");
            c.args([
                "qdisc",
                "replace",
                "dev",
                netns::IFACE,
                "root",
                "tbf",
                "rate",
                &format!("{mbit}mbit"),
                "burst",
                "32kb",
                "latency",
                "400ms",
            ]);
            check("tc qdisc replace", c.output()?)?;
        }
        Ok(())
    }

    /// Bytes the client host's veth received and sent so far.
    fn counters(&self) -> io::Result<(u64, u64)> {
        let read = |what: &str| -> io::Result<u64> {
            let out = self
                .pair
                .command(Side::Client, "cat")
                .arg(format!("/sys/class/net/{}/statistics/{what}", netns::IFACE))
                .output()?;
            let out = check("reading the veth's counters", out)?;
            out.trim()
                .parse()
                .map_err(|e| io::Error::other(format!("veth counter {out:?}: {e}")))
        };
        Ok((read("rx_bytes")?, read("tx_bytes")?))
    }
}

/// A finished command's stdout, or an error with its stderr.
fn check(what: &str, out: std::process::Output) -> io::Result<String> {
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(io::Error::other(format!(
            "{what}: {}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )))
    }
}

/// A site's directory, standing for a machine.
struct Site {
    /// The directory (images, QMP socket, console log, pid file).
    dir: PathBuf,
    /// The guest's RAM is the shared file DIR/vm-ram (lazy memory).
    lazy: bool,
}

impl Site {
    /// A new site at `dir`.
    fn new(dir: PathBuf) -> io::Result<Site> {
        std::fs::create_dir_all(&dir)?;
        Ok(Site { dir, lazy: false })
    }

    /// A new site at `dir` whose guest RAM is DIR/vm-ram, shared.
    fn new_lazy(dir: PathBuf) -> io::Result<Site> {
        let mut site = Site::new(dir)?;
        site.lazy = true;
        Ok(site)
    }

    /// The environment this site's guest is stored as.
    fn env(&self) -> &'static str {
        if self.lazy {
            ENV_LAZY
        } else {
            ENV
        }
    }

    /// QEMU's command line for the guest here (the same machine at every
    /// site, as in vm_isr.rs; only paths differ).
    fn qemu(&self, guest: &Path) -> Vec<String> {
        let s = |p: PathBuf| p.display().to_string();
        let mut args: Vec<String> = vec![
            "qemu-system-x86_64".into(),
            "-m".into(),
            "128".into(),
            "-nodefaults".into(),
            "-display".into(),
            "none".into(),
            "-no-reboot".into(),
            "-kernel".into(),
            s(guest.join("vmlinuz")),
            "-initrd".into(),
            s(guest.join("initrd.gz")),
            "-append".into(),
            "console=ttyS0 quiet panic=-1".into(),
            "-drive".into(),
            format!(
                "file={},format=raw,if=virtio",
                self.dir.join("disk.img").display()
            ),
            "-serial".into(),
            format!("file:{}", self.dir.join("serial").display()),
            "-qmp".into(),
            format!(
                "unix:{},server=on,wait=off",
                self.dir.join("qmp.sock").display()
            ),
            "-pidfile".into(),
            s(self.dir.join("qemu.pid")),
        ];
        if self.lazy {
            args.extend([
                "-object".into(),
                format!(
                    "memory-backend-file,id=mem,size=128M,mem-path={},share=on",
                    self.dir.join("vm-ram").display()
                ),
                "-machine".into(),
                "memory-backend=mem".into(),
            ]);
        }
        args
    }

    /// The tick numbers on the console so far.
    fn ticks(&self) -> Vec<u64> {
        let text = std::fs::read(self.dir.join("serial")).unwrap_or_default();
        String::from_utf8_lossy(&text)
            .lines()
            .filter_map(|l| {
                let rest = l.split("roam-guest: tick ").nth(1)?;
                let mut f = rest.split_whitespace();
                let n = f.next()?.parse().ok()?;
                (f.nth(2)? == "ok").then_some(n)
            })
            .collect()
    }

    /// Waits until the console shows a tick of at least `n`; returns when
    /// it was seen and the newest tick. Fails after `limit` or when `proc`
    /// exits, with the console's end.
    fn wait_tick(&self, n: u64, limit: Duration, proc: &mut Running) -> io::Result<(Instant, u64)> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(&last) = self.ticks().last().filter(|&&t| t >= n) {
                return Ok((Instant::now(), last));
            }
            check_cancelled()?;
            let exited = proc.child.try_wait()?;
            if exited.is_some() || Instant::now() > deadline {
                let console = std::fs::read(self.dir.join("serial")).unwrap_or_default();
                let console = String::from_utf8_lossy(&console);
                let tail: Vec<&str> = console.lines().rev().take(5).collect();
                return Err(io::Error::other(format!(
                    "no tick {n} at {} ({}); console ends {:?}; roam said: {}",
                    self.dir.display(),
                    exited.map_or(format!("not within {limit:?}"), |s| format!("exited {s}")),
                    tail,
                    proc.said()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Lines a process wrote, each with when it was read.
type Said = Arc<Mutex<Vec<(Instant, String)>>>;

/// A running process in the client host (QEMU, or `roam resume --vm` with
/// its QEMU), its output captured; dropping it kills both.
struct Running {
    /// The process.
    child: ChildGuard,
    /// QEMU's pid file (QEMU is `roam resume`'s child, not ours).
    pidfile: PathBuf,
    /// What it wrote on stdout and stderr.
    said: Said,
}

impl Running {
    /// Starts `cmd` (its stdout and stderr captured line by line).
    fn start(mut cmd: Command, pidfile: PathBuf) -> io::Result<Running> {
        let _ = std::fs::remove_file(&pidfile);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = ChildGuard::spawn(&mut cmd)?;
        let said: Said = Arc::default();
        let out = child
            .stdout
            .take()
            .map(|o| Box::new(o) as Box<dyn Read + Send>);
        let err = child
            .stderr
            .take()
            .map(|e| Box::new(e) as Box<dyn Read + Send>);
        for pipe in [out, err].into_iter().flatten() {
            let said = said.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines() {
                    let Ok(line) = line else { break };
                    if let Ok(mut v) = said.lock() {
                        v.push((Instant::now(), line));
                    }
                }
            });
        }
        Ok(Running {
            child,
            pidfile,
            said,
        })
    }

    /// When a line containing `needle` was first read, if one was.
    fn when(&self, needle: &str) -> Option<Instant> {
        let v = self.said.lock().ok()?;
        v.iter().find(|(_, l)| l.contains(needle)).map(|(t, _)| *t)
    }

    /// Everything said so far, one string.
    fn said(&self) -> String {
        self.said
            .lock()
            .map(|v| {
                v.iter()
                    .map(|(_, l)| l.as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default()
    }

    /// Waits for a line containing `needle`, at most `limit`.
    fn wait_for(&mut self, needle: &str, limit: Duration) -> io::Result<Instant> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(t) = self.when(needle) {
                return Ok(t);
            }
            check_cancelled()?;
            if Instant::now() > deadline || self.child.try_wait()?.is_some() {
                return Err(io::Error::other(format!(
                    "no {needle:?} within {limit:?}; it said: {}",
                    self.said()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for the process to exit by itself, at most `limit`.
    fn wait_exit(&mut self, limit: Duration) -> io::Result<()> {
        match self.child.wait_timeout(limit)? {
            Some(_) => Ok(()),
            None => Err(io::Error::other(format!(
                "did not exit within {limit:?}; it said: {}",
                self.said()
            ))),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(pid) = std::fs::read_to_string(&self.pidfile)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        // The child guard kills and reaps `roam` (or QEMU) itself.
    }
}

/// The number just before `label` in `text` (e.g. "618 uploaded").
fn number_before(text: &str, label: &str) -> io::Result<u64> {
    let at = text
        .find(label)
        .ok_or_else(|| io::Error::other(format!("no {label:?} in:\n{text}")))?;
    text[..at]
        .split_whitespace()
        .last()
        .map(|w| w.trim_start_matches('('))
        .and_then(|w| w.parse().ok())
        .ok_or_else(|| io::Error::other(format!("no number before {label:?} in:\n{text}")))
}

/// `roam suspend --vm` of the guest at `site`, timed; waits for its QEMU
/// (`qemu`) to quit.
fn suspend(
    net: &Net,
    tools: &Tools,
    dir: &Path,
    site: &Site,
    qemu: &mut Running,
    (which, rate_mbit): (&'static str, Option<u32>),
) -> io::Result<SuspendRow> {
    let (_, tx0) = net.counters()?;
    let start = Instant::now();
    let out = net
        .roam(tools, dir)
        .args([
            "suspend",
            "--env",
            site.env(),
            "--store",
            &format!("s3://{BUCKET}"),
        ])
        .arg("--vm")
        .arg(site.dir.join("qmp.sock"))
        .arg(site.dir.join("disk.img"))
        .stdin(Stdio::null())
        .output()?;
    let seconds = start.elapsed().as_secs_f64();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let text = check("roam suspend --vm", out)?;
    let (_, tx1) = net.counters()?;
    qemu.wait_exit(Duration::from_secs(30))?;
    let disk_line = stderr
        .lines()
        .find(|l| l.contains("] disk.img: done,"))
        .unwrap_or_default();
    Ok(SuspendRow {
        which,
        rate_mbit,
        disk_chunks_uploaded: number_before(disk_line, " chunks)")?,
        trickled_ahead: number_before(&text, " of the ").ok(),
        seconds,
        chunks_total: number_before(&text, " total,")?,
        chunks_uploaded: number_before(&text, " uploaded,")?,
        bytes_read: number_before(&text, " bytes), uploaded")?,
        bytes_uploaded: number_before(&text, " bytes, after compression")?,
        wire_bytes_sent: tx1.saturating_sub(tx0),
    })
}

/// `roam resume` of `version`'s images (no VM) into `into`: a lookaside
/// cache.
fn write_images(net: &Net, tools: &Tools, dir: &Path, version: u64, into: &Path) -> io::Result<()> {
    let out = net
        .roam(tools, dir)
        .args(["resume", "--env", ENV, "--store", &format!("s3://{BUCKET}")])
        .args(["--version", &version.to_string(), "--force"])
        .arg(into)
        .stdin(Stdio::null())
        .output()?;
    check("roam resume (images only)", out).map(drop)
}

/// `roam hoard` of the newest version into `hoard` (unlimited veth: the
/// hoard is made ahead of the resume).
fn hoard(net: &Net, tools: &Tools, dir: &Path, hoard: &Path) -> io::Result<HoardRow> {
    let (rx0, _) = net.counters()?;
    let start = Instant::now();
    let out = net
        .roam(tools, dir)
        .args(["hoard", "--env", ENV, "--store", &format!("s3://{BUCKET}")])
        .arg(hoard)
        .stdin(Stdio::null())
        .output()?;
    let seconds = start.elapsed().as_secs_f64();
    let text = check("roam hoard", out)?;
    let (rx1, _) = net.counters()?;
    Ok(HoardRow {
        version: number_before(&text, " from ")?,
        seconds,
        chunks_total: number_before(&text, " chunks, ")?,
        chunks_fetched: number_before(&text, " fetched (")?,
        object_bytes_fetched: number_before(&text, " bytes of objects)")?,
        wire_bytes: rx1.saturating_sub(rx0),
    })
}

/// `roam resume --vm` of the newest version into `site` with `extra`
/// options, started now.
fn resume_vm(
    net: &Net,
    tools: &Tools,
    dir: &Path,
    site: &Site,
    extra: &[String],
) -> io::Result<Running> {
    let mut cmd = net.roam(tools, dir);
    cmd.args(["resume", "--env", site.env()])
        .args(["--store", &format!("s3://{BUCKET}")])
        .args(["--force", "--vm"])
        .args(extra)
        .arg(&site.dir)
        .arg("--")
        .args(site.qemu(&tools.guest));
    Running::start(cmd, site.dir.join("qemu.pid"))
}

/// Pauses the guest behind the QMP socket `sock` (`stop`).
fn qmp_stop(sock: &Path) -> io::Result<()> {
    use std::io::Write;
    let stream = std::os::unix::net::UnixStream::connect(sock)?;
    stream.set_read_timeout(Some(SLACK))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    let mut line = String::new();
    reader.read_line(&mut line)?;
    for execute in ["qmp_capabilities", "stop"] {
        writeln!(writer, "{{\"execute\": \"{execute}\"}}")?;
        loop {
            line.clear();
            if reader.read_line(&mut line)? == 0 {
                return Err(io::Error::other("QEMU closed its QMP socket"));
            }
            if line.contains("\"return\"") {
                break;
            }
            if line.contains("\"error\"") {
                return Err(io::Error::other(format!("QMP {execute}: {line}")));
            }
        }
    }
    Ok(())
}

/// Seconds from `from` to `to`.
fn secs(from: Instant, to: Instant) -> f64 {
    to.saturating_duration_since(from).as_secs_f64()
}

/// The whole scenario, in `dir`.
/// `rates`: (Mbit/s, rounds) of the resumes.
fn measure(tools: &Tools, dir: &Path, rates: &[(u32, usize)]) -> io::Result<Isr> {
    let net = Net::start(tools, dir)?;
    progress(&format!(
        "isr: store (s3s-fs) at {} in the server namespace",
        net.endpoint
    ));

    // Site A: boot and suspend (version 1).
    let site_a = Site::new(dir.join("site-a"))?;
    std::fs::copy(tools.guest.join("disk.img"), site_a.dir.join("disk.img"))?;
    let args = site_a.qemu(&tools.guest);
    let mut cmd = net.pair.command(Side::Client, &args[0]);
    cmd.args(&args[1..]);
    let mut qemu_a = Running::start(cmd, site_a.dir.join("qemu.pid"))?;
    site_a.wait_tick(3, BOOT_TIMEOUT, &mut qemu_a)?;
    let first = suspend(&net, tools, dir, &site_a, &mut qemu_a, ("first", None))?;
    drop(qemu_a);
    progress(&format!(
        "isr: first suspend {:.2} s, {} of {} chunks uploaded",
        first.seconds, first.chunks_uploaded, first.chunks_total
    ));
    let stale = dir.join("lookaside-v1");
    write_images(&net, tools, dir, 1, &stale)?;
    // The resume site hoards version 1 now, version 2 once it exists.
    let hoard_dir = dir.join("hoard");
    let mut hoards = vec![hoard(&net, tools, dir, &hoard_dir)?];
    let memory_bytes = std::fs::metadata(stale.join("vm-memory"))?.len();
    let disk_bytes = std::fs::metadata(stale.join("disk.img"))?.len();

    // Site B1: resume, two ticks, suspend again (version 2) just before
    // the guest's next tick.
    let site_b = Site::new(dir.join("site-b1"))?;
    let n_a = *site_a.ticks().last().unwrap_or(&0);
    let mut at_b = resume_vm(&net, tools, dir, &site_b, &[])?;
    site_b.wait_tick(n_a + 2, BOOT_TIMEOUT, &mut at_b)?;
    let (seen, _) = site_b.wait_tick(n_a + 3, BOOT_TIMEOUT, &mut at_b)?;
    std::thread::sleep(Duration::from_millis(SUSPEND_AFTER_TICK_MS).saturating_sub(seen.elapsed()));
    let before = site_b.ticks().last().copied();
    let suspend_at = Instant::now();
    let second = suspend(&net, tools, dir, &site_b, &mut at_b, ("second", None))?;
    drop(at_b);
    let n_b = *site_b.ticks().last().unwrap_or(&0);
    // The guest's sleep left at the suspend: 1 s after the tick seen,
    // unless a later tick came first (then about a whole second).
    let residual_sleep_ms = if before == Some(n_b) {
        (TICK_MS - secs(seen, suspend_at) * 1e3).max(0.0)
    } else {
        TICK_MS
    };
    progress(&format!(
        "isr: second suspend {:.2} s, {} of {} chunks uploaded",
        second.seconds, second.chunks_uploaded, second.chunks_total
    ));
    let fresh = dir.join("lookaside-v2");
    write_images(&net, tools, dir, 2, &fresh)?;
    hoards.push(hoard(&net, tools, dir, &hoard_dir)?);
    for h in &hoards {
        progress(&format!(
            "isr: hoard of version {}: {:.2} s, {} of {} chunks fetched",
            h.version, h.seconds, h.chunks_fetched, h.chunks_total
        ));
    }

    // The same guest with lazy memory (environment ENV_LAZY): booted at
    // A with its RAM a shared file, suspended 850 ms after a tick as version
    // 2 was (one version: its resumes start from A's state).
    let site_al = Site::new_lazy(dir.join("site-a-lazy"))?;
    std::fs::copy(tools.guest.join("disk.img"), site_al.dir.join("disk.img"))?;
    let args = site_al.qemu(&tools.guest);
    let mut cmd = net.pair.command(Side::Client, &args[0]);
    cmd.args(&args[1..]);
    let mut qemu_al = Running::start(cmd, site_al.dir.join("qemu.pid"))?;
    site_al.wait_tick(3, BOOT_TIMEOUT, &mut qemu_al)?;
    let (seen, _) = site_al.wait_tick(4, BOOT_TIMEOUT, &mut qemu_al)?;
    std::thread::sleep(Duration::from_millis(SUSPEND_AFTER_TICK_MS).saturating_sub(seen.elapsed()));
    let lazy_row = suspend(
        &net,
        tools,
        dir,
        &site_al,
        &mut qemu_al,
        ("lazy memory", None),
    )?;
    drop(qemu_al);
    let n_lazy = *site_al.ticks().last().unwrap_or(&0);
    progress(&format!(
        "isr: lazy-memory suspend {:.2} s, {} of {} chunks uploaded",
        lazy_row.seconds, lazy_row.chunks_uploaded, lazy_row.chunks_total
    ));

    let mut samples: Vec<ResumeRow> = Vec::new();
    for &(rate, rounds) in rates {
        net.rate(rate)?;
        // The longest a resume at this rate may take to its first tick.
        let limit = SLACK + Duration::from_secs_f64(MAX_RESUME_BYTES * 8.0 / (rate as f64 * 1e6));
        for (round, policy) in (0..rounds).flat_map(|round| {
            crate::peers::order(Policy::ALL.len(), round)
                .into_iter()
                .map(move |i| (round, Policy::ALL[i]))
        }) {
            check_cancelled()?;
            let site_dir = dir.join(format!("resume-{rate}-{policy:?}-{round}"));
            let (site, n_from) = if policy == Policy::LazyMemory {
                (Site::new_lazy(site_dir)?, n_lazy)
            } else {
                (Site::new(site_dir)?, n_b)
            };
            let extra: Vec<String> = match policy {
                Policy::CopyIn => vec![],
                Policy::DemandFetch | Policy::LazyMemory => vec!["--demand-fetch".into()],
                Policy::LookasideFresh => vec!["--lookaside".into(), fresh.display().to_string()],
                Policy::LookasideStale => vec!["--lookaside".into(), stale.display().to_string()],
                Policy::Hoarded => vec!["--lookaside".into(), hoard_dir.display().to_string()],
            };
            let (rx0, _) = net.counters()?;
            let start = Instant::now();
            let mut r = resume_vm(&net, tools, dir, &site, &extra)?;
            let (t1, _) = site.wait_tick(n_from + 1, limit, &mut r)?;
            let (t3, _) = site.wait_tick(n_from + 3, SLACK, &mut r)?;
            let fill_done = match policy {
                Policy::DemandFetch => Some(r.wait_for("background fill done", limit)?),
                // Both fills (disk and RAM): the RAM's is the larger.
                Policy::LazyMemory => Some(r.wait_for("vm-ram: background fill done", limit)?),
                _ => None,
            };
            let (rx1, _) = net.counters()?;
            let guest_runs = r.when("the guest runs").map(|t| secs(start, t));
            let said = r.said();
            // ROAM_BENCH_SAID=1: each line the resume said, timed (where its
            // time goes).
            if std::env::var_os("ROAM_BENCH_SAID").is_some() {
                if let Ok(v) = r.said.lock() {
                    for (t, l) in v.iter() {
                        eprintln!("SAID {:?} {:.3} {l}", policy, secs(start, *t));
                    }
                }
            }
            drop(r);
            let wire_bytes = rx1.saturating_sub(rx0);
            let (lookaside_bytes, fetched_bytes) = if matches!(
                policy,
                Policy::LookasideFresh | Policy::LookasideStale | Policy::Hoarded
            ) {
                (
                    Some(number_before(&said, " bytes local,")?),
                    Some(number_before(&said, " bytes fetched,")?),
                )
            } else {
                (None, None)
            };
            let row = ResumeRow {
                rate_mbit: rate,
                policy,
                guest_runs_s: guest_runs,
                first_tick_s: secs(start, t1),
                two_ticks_s: secs(t1, t3),
                fill_done_s: fill_done.map(|t| secs(start, t)),
                wire_bytes,
                lookaside_bytes,
                fetched_bytes,
                wire_saved_pct: None,
                n: 1,
            };
            progress(&format!(
                "isr: {rate} Mbit/s {}: guest runs {}, first tick {:.2} s, {:.1} MB received",
                policy.label(),
                row.guest_runs_s.map_or("-".into(), |s| format!("{s:.2} s")),
                row.first_tick_s,
                wire_bytes as f64 / 1e6
            ));
            samples.push(row);
            // Each resume wrote ~150 MB: keep the scratch small.
            let _ = std::fs::remove_dir_all(&site.dir);
        }
    }
    // Suspend after a run, with and without trickle write-back, over each
    // limited link: resumed by demand fetch, three ticks (each appends to
    // the disk), the guest paused (the user walks away) and 3 s later
    // suspended. Each suspend writes the next version; the next run resumes it.
    let mut suspends = vec![first, second, lazy_row];
    let mut n_last = n_b;
    for &(rate, _) in rates {
        net.rate(rate)?;
        let limit = SLACK + Duration::from_secs_f64(MAX_RESUME_BYTES * 8.0 / (rate as f64 * 1e6));
        for trickle in [false, true] {
            check_cancelled()?;
            let site = Site::new(dir.join(format!("after-run-{rate}-{trickle}")))?;
            let mut extra = vec!["--demand-fetch".to_string()];
            if trickle {
                extra.extend(["--trickle".into(), format!("{rate}M")]);
            }
            let mut r = resume_vm(&net, tools, dir, &site, &extra)?;
            site.wait_tick(n_last + 3, limit, &mut r)?;
            r.wait_for("background fill done", limit)?;
            qmp_stop(&site.dir.join("qmp.sock"))?;
            std::thread::sleep(Duration::from_secs(3));
            let which = if trickle { "trickled run" } else { "run" };
            let row = suspend(&net, tools, dir, &site, &mut r, (which, Some(rate)))?;
            n_last = site.ticks().last().copied().unwrap_or(n_last);
            progress(&format!(
                "isr: {rate} Mbit/s suspend after a {which}: {:.2} s, {} of {} chunks uploaded \
                 ({} of the disk's), {} written back ahead",
                row.seconds,
                row.chunks_uploaded,
                row.chunks_total,
                row.disk_chunks_uploaded,
                row.trickled_ahead.unwrap_or(0)
            ));
            suspends.push(row);
            drop(r);
            let _ = std::fs::remove_dir_all(&site.dir);
        }
    }
    let resumes = medians(rates, &samples);
    let goals = goals(&resumes);
    let notes = vec![
        format!(
            "Guest: 128 MiB of memory (its migration stream, the memory image, is {:.1} MB) and a {:.1} MB disk; version 2 is the same guest after two more ticks.",
            memory_bytes as f64 / 1e6,
            disk_bytes as f64 / 1e6
        ),
        "Lazy memory: the same guest booted with its RAM a shared file (`-object memory-backend-file,share=on,mem-path=DIR/vm-ram`), suspended 850 ms after a tick as its own environment (vm-ram 134 MB flat, vm-devstate 0.4 MB); its demand-fetch resume copies in the device state only, maps the RAM from roam's FUSE file (chunks fetched on touch, readahead refused) and starts the background fill once the guest has not faulted for 1.5 s. It resumes that version 1, not version 2.".into(),
        "Store: s3s-fs in the server namespace; every roam command and QEMU in the client namespace; the veth between them rate-limited by tbf on both ends (burst 32 kB) for the resumes, unlimited for the suspends.".into(),
        format!(
            "Times from the command's start (`ip netns exec` included). First tick: the guest's first console line after the resume, its first interaction; it includes what was left of its 1 s sleep at the suspend, ~{residual_sleep_ms:.0} ms here. Guest runs: roam's line saying QEMU loaded the memory and the guest runs."
        ),
        "Two ticks: first to third tick after the resume; the guest sleeps 2 s in it, the rest is the ticks' work (append, sync, read the file back) and any slowdown (demand fetch: chunks fetched on first touch, the background fill).".into(),
        "Wire bytes: received on the client host's veth during the resume (HTTP and TCP included; the demand fetch's until its background fill was done). Saved: 1 - lookaside wire bytes / copy-in wire bytes at the same rate.".into(),
    ];
    Ok(Isr {
        notes,
        memory_bytes,
        disk_bytes,
        suspends,
        hoards,
        residual_sleep_ms,
        resumes,
        samples,
        goals,
    })
}

/// One row per link rate and policy: the median of each figure over its
/// samples, and the lookaside's wire bytes saved against copy-in's median.
fn medians(rates: &[(u32, usize)], samples: &[ResumeRow]) -> Vec<ResumeRow> {
    use crate::stats::median;
    let mut rows: Vec<ResumeRow> = Vec::new();
    for &(rate, _) in rates {
        let mut copy_in_wire = None;
        for policy in Policy::ALL {
            let of: Vec<&ResumeRow> = samples
                .iter()
                .filter(|r| r.rate_mbit == rate && r.policy == policy)
                .collect();
            let Some(first) = of.first() else { continue };
            let med = |f: &dyn Fn(&ResumeRow) -> Option<f64>| -> Option<f64> {
                let v: Vec<f64> = of.iter().filter_map(|r| f(r)).collect();
                (!v.is_empty()).then(|| median(&v))
            };
            let wire = med(&|r| Some(r.wire_bytes as f64)).unwrap_or(0.0);
            if policy == Policy::CopyIn {
                copy_in_wire = Some(wire);
            }
            let lookaside_bytes = med(&|r| r.lookaside_bytes.map(|b| b as f64));
            rows.push(ResumeRow {
                rate_mbit: rate,
                policy,
                guest_runs_s: med(&|r| r.guest_runs_s),
                first_tick_s: med(&|r| Some(r.first_tick_s)).unwrap_or(first.first_tick_s),
                two_ticks_s: med(&|r| Some(r.two_ticks_s)).unwrap_or(first.two_ticks_s),
                fill_done_s: med(&|r| r.fill_done_s),
                wire_bytes: wire as u64,
                lookaside_bytes: lookaside_bytes.map(|b| b as u64),
                fetched_bytes: med(&|r| r.fetched_bytes.map(|b| b as f64)).map(|b| b as u64),
                wire_saved_pct: lookaside_bytes
                    .and(copy_in_wire)
                    .map(|c| 100.0 * (1.0 - wire / c.max(1.0))),
                n: of.len(),
            });
        }
    }
    rows
}

/// The three goals against the resumes at 100 Mbit/s.
fn goals(resumes: &[ResumeRow]) -> Vec<Goal> {
    let at = |p: Policy| resumes.iter().find(|r| r.rate_mbit == 100 && r.policy == p);
    let mut v = Vec::new();
    if let Some(r) = at(Policy::LookasideFresh) {
        v.push(Goal {
            goal: "warm resume (fresh lookaside) of a 100 MB environment ≤ 1 s",
            measured: format!(
                "{:.2} s to the first tick ({} to the guest running), 146 MB environment, 100 Mbit/s",
                r.first_tick_s,
                r.guest_runs_s.map_or("-".into(), |s| format!("{s:.2} s"))
            ),
            met: r.first_tick_s <= 1.0,
        });
        if let Some(saved) = r.wire_saved_pct {
            v.push(Goal {
                goal: "lookaside cuts remote bytes ≥ 90 % (fresh cache)",
                measured: format!("{saved:.1} % of the copy-in's wire bytes saved"),
                met: saved >= 90.0,
            });
        }
    }
    if let Some(r) = at(Policy::LazyMemory) {
        v.push(Goal {
            goal: "demand-fetch resume ≤ 2 s to first interaction over 100 Mbit/s (lazy memory)",
            measured: format!(
                "{:.2} s to the first tick ({} to the guest running)",
                r.first_tick_s,
                r.guest_runs_s.map_or("-".into(), |s| format!("{s:.2} s"))
            ),
            met: r.first_tick_s <= 2.0,
        });
    }
    if let Some(r) = at(Policy::DemandFetch) {
        v.push(Goal {
            goal: "demand-fetch resume ≤ 2 s to first interaction over 100 Mbit/s",
            measured: format!(
                "{:.2} s to the first tick ({} to the guest running)",
                r.first_tick_s,
                r.guest_runs_s.map_or("-".into(), |s| format!("{s:.2} s"))
            ),
            met: r.first_tick_s <= 2.0,
        });
    }
    v
}

/// Section 13 of results.md.
pub(crate) fn section(s: &mut String, o: &crate::Outcome<Isr>) {
    use std::fmt::Write;
    let _ = writeln!(
        s,
        "\n## 13. Suspend here, resume there (Internet Suspend/Resume of a QEMU guest)\n"
    );
    if let Some(x) = crate::report::status_line(o) {
        *s += &x;
    }
    let Some(t) = o.ok() else {
        return;
    };
    for n in &t.notes {
        let _ = writeln!(s, "- {n}");
    }
    let _ = writeln!(s, "\n| goal | measured | met |\n|---|---|---|");
    for g in &t.goals {
        let _ = writeln!(
            s,
            "| {} | {} | {} |",
            g.goal,
            g.measured,
            if g.met { "yes" } else { "**no**" }
        );
    }
    let _ = writeln!(
        s,
        "\nSuspends (first and second: unlimited veth; after a run: resumed by demand fetch, three ticks, the guest paused and suspended 3 s later, over the limited veth, with and without `--trickle` at the link's rate):\n\n| suspend | link | s | disk chunks uploaded | written back ahead | chunks uploaded / total | read MB | uploaded MB | sent on the wire MB |\n|---|---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in &t.suspends {
        let _ = writeln!(
            s,
            "| {} | {} | {:.2} | {} | {} | {} / {} | {:.1} | {:.2} | {:.2} |",
            r.which,
            r.rate_mbit
                .map_or("unlimited".into(), |m| format!("{m} Mbit/s")),
            r.seconds,
            r.disk_chunks_uploaded,
            r.trickled_ahead.map_or("–".into(), |n| n.to_string()),
            r.chunks_uploaded,
            r.chunks_total,
            r.bytes_read as f64 / 1e6,
            r.bytes_uploaded as f64 / 1e6,
            r.wire_bytes_sent as f64 / 1e6
        );
    }
    let _ = writeln!(
        s,
        "\nHoards at the resume site (`roam hoard`, unlimited veth, ahead of the resumes; version 2 over version 1's hoard):\n\n| version | s | chunks fetched / total | object MB fetched | received MB |\n|---|---:|---:|---:|---:|"
    );
    for h in &t.hoards {
        let _ = writeln!(
            s,
            "| {} | {:.2} | {} / {} | {:.2} | {:.2} |",
            h.version,
            h.seconds,
            h.chunks_fetched,
            h.chunks_total,
            h.object_bytes_fetched as f64 / 1e6,
            h.wire_bytes as f64 / 1e6
        );
    }
    let _ = writeln!(
        s,
        "\nResumes of version 2 (medians of n; s from the command's start; MB = 10^6 bytes):\n\n| link | policy | n | guest runs | first tick | first to third tick | fill done | received MB | lookaside local / fetched MB | wire saved |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let opt = |v: Option<f64>| v.map_or("–".to_string(), |x| format!("{x:.2}"));
    for r in &t.resumes {
        let _ = writeln!(
            s,
            "| {} Mbit/s | {} | {} | {} | {:.2} | {:.2} | {} | {:.2} | {} | {} |",
            r.rate_mbit,
            r.policy.label(),
            r.n,
            opt(r.guest_runs_s),
            r.first_tick_s,
            r.two_ticks_s,
            opt(r.fill_done_s),
            r.wire_bytes as f64 / 1e6,
            match (r.lookaside_bytes, r.fetched_bytes) {
                (Some(l), Some(f)) => format!("{:.1} / {:.1}", l as f64 / 1e6, f as f64 / 1e6),
                _ => "–".into(),
            },
            r.wire_saved_pct.map_or("–".into(), |p| format!("{p:.1} %"))
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_come_from_roams_summaries() {
        let text = "  chunks: 1118 total, 618 uploaded, 500 already stored\n  read 146.5 MB (146516091 bytes), uploaded 25.1 MB (25137143 bytes, after compression) in 1.17 s";
        assert_eq!(number_before(text, " total,").unwrap(), 1118);
        assert_eq!(number_before(text, " uploaded,").unwrap(), 618);
        assert_eq!(
            number_before(text, " bytes), uploaded").unwrap(),
            146_516_091
        );
        assert_eq!(
            number_before(text, " bytes, after compression").unwrap(),
            25_137_143
        );
        let la = "  lookaside: 70 of 72 chunks (9.2 MB) taken locally, 0.3 MB fetched: 9200000 bytes local, 2 chunks and 300000 bytes fetched, 1 bytes";
        assert_eq!(number_before(la, " bytes local,").unwrap(), 9_200_000);
        assert_eq!(number_before(la, " bytes fetched,").unwrap(), 300_000);
        assert!(number_before(la, " nothing").is_err());
    }
}
