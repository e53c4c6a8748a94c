//! Drives [CRIU](https://criu.org) — checkpoint/restore in user space — for
//! roam's process migration (issue 12; `docs/ARCHITECTURE.md`, "Process
//! migration").
//!
//! CRIU is the engine: it freezes a process tree, writes its memory, file
//! descriptors and sockets (established TCP connections included, with
//! `tcp_established`) to an images directory, and rebuilds the tree from
//! those images. roam does not checkpoint anything itself; it tells CRIU what
//! to do through CRIU's RPC interface, as container runtimes do: `criu swrk
//! FD` is started with one end of a `SOCK_SEQPACKET` pair, and each request
//! and response is one protobuf message (`criu_req`/`criu_resp` of CRIU's
//! `rpc.proto`, whose generated types come from the `rust-criu` crate).
//!
//! - [`Criu::locate`] finds a CRIU that works here (`$ROAM_CRIU`, else `criu`
//!   on `PATH`) and refuses one older than 4.1 with the reason (this kernel's
//!   vDSO layout breaks CRIU 3.x; `scripts/criu-build` builds 4.1.1).
//! - [`Criu::dump`] checkpoints a process tree; [`Criu::restore`] brings it
//!   back. With [`Criu::in_netns`], CRIU runs inside a named network namespace
//!   (`nsenter --net`), where the process and its addresses live: CRIU must
//!   share the process's network namespace to dump and restore its sockets.
//!   (Not `ip netns exec`, which also gives its program a mount namespace of
//!   its own: CRIU would then see the process in a foreign one and try to
//!   dump that too.)
//! - Every failure is an [`Error`] that says what failed, CRIU's own message
//!   and the tail of CRIU's log (kept in the images directory).
//!
//! The network lock: while a process with established connections is being
//! dumped, and until it is restored, CRIU drops its connections' packets (an
//! nftables table or iptables rules in the process's namespace), so the peer
//! neither gets a reset nor sees an acknowledgement for bytes the image does
//! not hold; its retransmissions reach the restored process.

use std::fmt;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use protobuf::{Message, MessageField};
use rust_criu::rust_criu_protobuf::rpc;
use socket2::{Domain, Socket, Type};

/// The oldest CRIU roam accepts: 3.x fails on this kernel at start-up
/// ("vdso: Unexpected rt vDSO area bounds").
pub const MIN_VERSION: Version = Version {
    major: 4,
    minor: 1,
    sublevel: 0,
};

/// Longest wait for one CRIU request (a dump of a large process writes its
/// whole memory; a hung CRIU must not hang roam).
const RPC_TIMEOUT: Duration = Duration::from_secs(300);

/// Lines of CRIU's log quoted in an error.
const LOG_TAIL_LINES: usize = 12;

/// A CRIU version (`major.minor.sublevel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    /// The major number (4 for 4.1.1).
    pub major: u32,
    /// The minor number (1 for 4.1.1).
    pub minor: u32,
    /// The sublevel (1 for 4.1.1).
    pub sublevel: u32,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.sublevel)
    }
}

/// How much CRIU writes to its logs (`dump.log`, `restore.log`,
/// `lazy-pages.log` in the images directory).
///
/// CRIU writes each log line with a system call of its own, while the
/// process is frozen. At debug level a dump or restore of 1,000 TCP
/// connections writes about 20 lines per connection: on a 2-core AMD EPYC
/// machine (270 ns per empty system call) a move of 1 GB and 1,000
/// connections froze for a median 470 ms with it and 402 ms with
/// [`LogLevel::Warnings`] (8 runs each, alternating; CRIU's restore 126 →
/// 83 ms). Errors are logged at every level, so a failure still quotes
/// CRIU's own reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogLevel {
    /// Errors only (CRIU's `-v1`).
    Errors,
    /// Errors and warnings (`-v2`): the default.
    #[default]
    Warnings,
    /// And CRIU's progress messages (`-v3`).
    Info,
    /// Everything (`-v4`): what to send with a bug report.
    Debug,
}

impl LogLevel {
    /// CRIU's number for it (`-vN`, `log_level` over RPC).
    pub fn number(self) -> i32 {
        match self {
            LogLevel::Errors => 1,
            LogLevel::Warnings => 2,
            LogLevel::Info => 3,
            LogLevel::Debug => 4,
        }
    }
}

/// How CRIU keeps a dumped process's connections quiet until it is restored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NetworkLock {
    /// An nftables table in the process's network namespace (the default:
    /// needs no iptables and removes cleanly with the table).
    #[default]
    Nftables,
    /// iptables rules (CRIU's own default).
    Iptables,
    /// No lock: the caller blocks the traffic itself. Without any lock the
    /// peer's packets during the dump draw resets.
    Skip,
}

impl NetworkLock {
    fn rpc(self) -> rpc::Criu_network_lock_method {
        match self {
            NetworkLock::Nftables => rpc::Criu_network_lock_method::NFTABLES,
            NetworkLock::Iptables => rpc::Criu_network_lock_method::IPTABLES,
            NetworkLock::Skip => rpc::Criu_network_lock_method::SKIP,
        }
    }
}

/// What a dump takes and how.
#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    /// Dump established TCP connections (`--tcp-established`); without it a
    /// process with one fails to dump.
    pub tcp_established: bool,
    /// Leave the process running after the dump (a copy, not a move). When
    /// `false` CRIU kills it once the images are complete.
    pub leave_running: bool,
    /// The network lock (see [`NetworkLock`]).
    pub network_lock: NetworkLock,
    /// The tree was started from a shell and shares its session or terminal
    /// (`--shell-job`).
    pub shell_job: bool,
    /// Dump the process's connected Unix sockets whose peer is outside the
    /// tree (`--ext-unix-sk`).
    pub ext_unix_sk: bool,
    /// Dump file locks (`--file-locks`).
    pub file_locks: bool,
}

/// Set to `1` in the environment of a lazy dump's CRIU ([`Criu::dump_lazily_then`]):
/// the CRIU roam builds (`scripts/criu-build`, patch 0003) then leaves the
/// lazy memory in the frozen tree instead of capturing it into its page
/// pipes inside the freeze, and its page server refuses to serve it (the
/// caller serves it from the frozen tree's memory). A stock CRIU ignores it.
pub const LAZY_UNPIPED_ENV: &str = "CRIU_LAZY_PAGES_UNPIPED";

/// CRIU's largest page pipe, which a lazy dump fills and its page server
/// asks for (819 pages: `PIPE_MAX_SIZE` of CRIU's `page-pipe.h` on x86-64).
pub const LAZY_PIPE_BYTES: u64 = 819 * 4096;

/// Room for a lazy dump's page pipes. A process without `CAP_SYS_RESOURCE`
/// cannot grow a pipe past `/proc/sys/fs/pipe-max-size` (1 MiB by
/// default): a stock CRIU's lazy dump then fills smaller pipes, and its
/// page server fails at its first page ("tee: ... Operation not
/// permitted"; roam's never asks it). [`PipeRoom::make`] raises the limit
/// to 4 MiB where it is lower and this process lacks the capability (root
/// may write the sysctl), and puts the old value back when dropped.
///
/// A lazy dump by a stock CRIU is faster with the room made before it: its
/// page pipes then hold 819 pages instead of 256, and the parasite fills a
/// quarter as many (1 GB: its memory work 114-133 ms against 60-70 ms). A
/// dump that writes the memory is slower with them (423 ms against 1.3-1.7
/// s at 1 GB): make none for it. Nor for a CRIU that knows
/// [`LAZY_UNPIPED_ENV`] ([`Criu::knows_lazy_unpiped`]): its lazy dump
/// fills no page pipes, and its page server serves nothing.
///
/// A process killed outright cannot put the value back itself: a watcher
/// (`sh`, in a process group of its own so a terminal's ^C spares it) reads
/// a pipe from this process and, at its end (this process dropped the room
/// or died), puts the old value back if the limit is still the one set here
/// (another holder may have changed it since).
#[derive(Debug)]
pub struct PipeRoom {
    /// The value to put back, if it was raised.
    old: Option<String>,
    /// The watcher that puts it back, and the write end of its pipe.
    watcher: Option<(std::process::Child, std::process::ChildStdin)>,
}

impl PipeRoom {
    /// The sysctl.
    const PATH: &'static str = "/proc/sys/fs/pipe-max-size";

    /// The value it is raised to.
    const RAISED: u64 = 4 << 20;

    /// Raises the limit if needed (see [`PipeRoom`]); why not, if it cannot.
    pub fn make() -> Result<PipeRoom, String> {
        let old = std::fs::read_to_string(Self::PATH).unwrap_or_default();
        let max: u64 = old.trim().parse().unwrap_or(0);
        if max >= LAZY_PIPE_BYTES || has_cap_sys_resource() {
            return Ok(PipeRoom {
                old: None,
                watcher: None,
            });
        }
        let old = old.trim().to_string();
        let refused = |why: String| {
            format!(
                "CRIU's lazy dump fills pipes of {LAZY_PIPE_BYTES} bytes at most; this host \
                 allows {max} (fs.pipe-max-size) to a process without CAP_SYS_RESOURCE, and \
                 raising it failed: {why}"
            )
        };
        // The watcher first: from the raise on, something puts it back.
        let watcher = Self::watch(&old).map_err(|e| refused(format!("cannot start sh: {e}")))?;
        let room = PipeRoom {
            old: Some(old),
            watcher: Some(watcher),
        };
        // Dropped on failure: the watcher finds the old value and leaves it.
        std::fs::write(Self::PATH, Self::RAISED.to_string()).map_err(|e| refused(e.to_string()))?;
        Ok(room)
    }

    /// Starts the watcher that puts `old` back at the end of its input
    /// (see [`PipeRoom`]).
    fn watch(old: &str) -> std::io::Result<(std::process::Child, std::process::ChildStdin)> {
        use std::os::unix::process::CommandExt;
        let script = r#"trap '' INT TERM HUP QUIT
cat > /dev/null
[ "$(cat "$1")" = "$2" ] && echo "$3" > "$1"
exit 0"#;
        let mut child = std::process::Command::new("sh")
            .args(["-c", script, "roam-pipe-room", Self::PATH])
            .arg(Self::RAISED.to_string())
            .arg(old)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .process_group(0)
            .spawn()?;
        let stdin = child.stdin.take().expect("piped stdin");
        Ok((child, stdin))
    }

    /// Whether the limit was raised (and will be put back).
    pub fn raised(&self) -> bool {
        self.old.is_some()
    }
}

impl Drop for PipeRoom {
    fn drop(&mut self) {
        if let Some((mut child, stdin)) = self.watcher.take() {
            // Its input ends: it puts the value back and exits at once.
            drop(stdin);
            let _ = child.wait();
        }
    }
}

/// Whether this process has `CAP_SYS_RESOURCE` (bit 24 of `CapEff`).
fn has_cap_sys_resource() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << 24) != 0)
}

/// How a restore runs.
#[derive(Debug, Clone, Default)]
pub struct RestoreOptions {
    /// Restore established TCP connections from the images (as dumped with
    /// [`DumpOptions::tcp_established`]).
    pub tcp_established: bool,
    /// The lock the dump used: the restore lifts it once the connections are
    /// back.
    pub network_lock: NetworkLock,
    /// As [`DumpOptions::shell_job`].
    pub shell_job: bool,
    /// As [`DumpOptions::ext_unix_sk`].
    pub ext_unix_sk: bool,
    /// As [`DumpOptions::file_locks`].
    pub file_locks: bool,
    /// Post-copy: the process's private memory is not read from the
    /// images here (a lazy dump's hold none of it); each page is fetched
    /// when the restored process first touches it (or in the background)
    /// by the lazy-pages daemon running on the same images directory,
    /// which must be started first ([`Criu::lazy_pages_daemon`]), from the
    /// source's page server ([`Criu::dump_lazily_then`]'s).
    pub lazy_pages: bool,
}

/// The caller's step at the end of [`Criu::dump_then`]: given the images
/// directory; `Err` (a reason) rolls the dump back.
pub type PostDump<'a> = dyn FnMut(&Path) -> Result<(), String> + 'a;

/// The step a dump takes before it freezes anything (CRIU's "pre-dump"
/// action, after its own start-up and before it seizes the tree): `Ok`
/// lets it go on, `Err(reason)` calls it off with [`Error::Aborted`],
/// nothing frozen. A caller that must hold the tree's network still while
/// it is frozen takes its lock here rather than before the dump: CRIU's
/// start-up (its kernel probes, 40-50 ms on the machines measured) then
/// runs while the tree still serves.
pub type PreDump<'a> = dyn FnMut() -> Result<(), String> + 'a;

/// A finished dump.
#[derive(Debug, Clone)]
pub struct Dumped {
    /// Wall time of the RPC request: the process was frozen for (at most) this long.
    pub elapsed: Duration,
    /// Bytes of the images (CRIU's logs in the directory not counted: at
    /// debug level a dump of 1,000 connections logs 1.4 MB).
    pub image_bytes: u64,
}

/// A finished restore.
#[derive(Debug, Clone)]
pub struct Restored {
    /// The restored tree's root process (its pid is the dumped one's: CRIU
    /// restores pids).
    pub pid: i32,
    /// Wall time of the RPC request.
    pub elapsed: Duration,
}

/// Why a CRIU operation failed.
#[derive(Debug)]
pub enum Error {
    /// No CRIU binary was found (neither `$ROAM_CRIU` nor `criu` on `PATH`).
    NotFound,
    /// CRIU is too old to run on this kernel.
    TooOld {
        /// The binary.
        path: PathBuf,
        /// Its version.
        version: Version,
    },
    /// CRIU could not be started.
    Spawn {
        /// The binary.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// Talking to CRIU failed (it died, or a message did not go through).
    Io {
        /// The request (`dump`, `restore`, `version`).
        op: &'static str,
        /// Why.
        source: io::Error,
    },
    /// CRIU answered with something that is not a valid response.
    Protocol {
        /// The request.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// CRIU ran the request and it failed.
    Failed {
        /// The request.
        op: &'static str,
        /// CRIU's message (`cr_errmsg`), if it gave one.
        message: String,
        /// CRIU's errno, if it gave one.
        errno: Option<i32>,
        /// Where CRIU's log is.
        log: Option<PathBuf>,
        /// The last lines of that log.
        log_tail: String,
    },
    /// An [`AddressLock`] could not be put in place or removed.
    Lock {
        /// What `nft` said.
        detail: String,
    },
    /// The caller's post-dump step ([`Criu::dump_then`]) refused: CRIU
    /// rolled the dump back and the process runs on where it was, its
    /// connections untouched.
    Aborted {
        /// The step's reason.
        reason: String,
    },
    /// No answer within five minutes: CRIU was killed.
    Timeout {
        /// The request.
        op: &'static str,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NotFound => write!(
                f,
                "CRIU not found: set ROAM_CRIU to a criu binary (>= {MIN_VERSION}) or put one \
                 on PATH; scripts/criu-build builds one from source"
            ),
            Error::TooOld { path, version } => write!(
                f,
                "{} is CRIU {version}, which fails on this kernel; roam needs CRIU >= \
                 {MIN_VERSION} (scripts/criu-build builds one from source)",
                path.display()
            ),
            Error::Spawn { path, source } => {
                write!(f, "could not start {} swrk: {source}", path.display())
            }
            Error::Io { op, source } => write!(f, "criu {op}: talking to CRIU failed: {source}"),
            Error::Protocol { op, detail } => write!(f, "criu {op}: bad response: {detail}"),
            Error::Failed {
                op,
                message,
                errno,
                log,
                log_tail,
            } => {
                write!(f, "criu {op} failed")?;
                if !message.is_empty() {
                    write!(f, ": {message}")?;
                }
                if let Some(e) = errno {
                    write!(f, " ({})", io::Error::from_raw_os_error(*e))?;
                }
                if let Some(log) = log {
                    write!(f, "; CRIU's log: {}", log.display())?;
                }
                if !log_tail.is_empty() {
                    write!(f, "; its last lines:\n{log_tail}")?;
                }
                Ok(())
            }
            Error::Lock { detail } => write!(f, "address lock: {detail}"),
            Error::Aborted { reason } => write!(
                f,
                "dump rolled back (the process runs on here, its connections untouched): {reason}"
            ),
            Error::Timeout { op } => write!(
                f,
                "criu {op}: no answer within {} s; CRIU was killed",
                RPC_TIMEOUT.as_secs()
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Spawn { source, .. } | Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// A CRIU binary roam can drive, and where it runs.
#[derive(Debug, Clone)]
pub struct Criu {
    /// The binary.
    path: PathBuf,
    /// Its version, as it answered over RPC.
    version: Version,
    /// The network namespace it runs in (`None`: the caller's).
    netns: Option<String>,
    /// How much it logs.
    log_level: LogLevel,
}

impl Criu {
    /// The CRIU named by `$ROAM_CRIU`, else `criu` on `PATH`, if it is at
    /// least [`MIN_VERSION`].
    pub fn locate() -> Result<Criu, Error> {
        let path = match std::env::var_os("ROAM_CRIU") {
            Some(p) if !p.is_empty() => PathBuf::from(p),
            _ => on_path("criu").ok_or(Error::NotFound)?,
        };
        Criu::at(&path)
    }

    /// The CRIU binary at `path`, if it runs and is at least [`MIN_VERSION`].
    pub fn at(path: &Path) -> Result<Criu, Error> {
        if !path.is_file() {
            return Err(Error::Spawn {
                path: path.to_owned(),
                source: io::Error::new(io::ErrorKind::NotFound, "no such file"),
            });
        }
        let mut criu = Criu {
            path: path.to_owned(),
            version: MIN_VERSION,
            netns: None,
            log_level: LogLevel::default(),
        };
        criu.version = criu.query_version()?;
        if criu.version < MIN_VERSION {
            return Err(Error::TooOld {
                path: criu.path,
                version: criu.version,
            });
        }
        Ok(criu)
    }

    /// The same CRIU, run inside the named network namespace
    /// (`/run/netns/NS`, as `ip netns add` makes), where the processes it
    /// dumps or restores live. Only the network namespace is entered.
    pub fn in_netns(mut self, ns: &str) -> Criu {
        self.netns = Some(ns.to_owned());
        self
    }

    /// The same CRIU, logging at `level` (see [`LogLevel`]; the default
    /// is [`LogLevel::Warnings`]).
    pub fn log_level(mut self, level: LogLevel) -> Criu {
        self.log_level = level;
        self
    }

    /// The binary.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its version.
    pub fn version(&self) -> Version {
        self.version
    }

    /// Whether it knows [`LAZY_UNPIPED_ENV`] (`criu check --feature
    /// lazy_pages_unpiped`, which the CRIU roam builds answers and a stock
    /// one refuses): if so, a lazy dump captures none of the lazy memory
    /// into its page pipes, and needs no [`PipeRoom`].
    pub fn knows_lazy_unpiped(&self) -> bool {
        Command::new(&self.path)
            .args(["check", "--feature", "lazy_pages_unpiped"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Checkpoints the process tree rooted at `pid` into `images` (an
    /// existing, preferably empty directory). Unless
    /// [`DumpOptions::leave_running`], the tree is gone afterwards: only a
    /// [`Criu::restore`] brings it back.
    pub fn dump(&self, pid: i32, images: &Path, opts: &DumpOptions) -> Result<Dumped, Error> {
        self.dump_inner(pid, images, opts, None, None, None)
    }

    /// [`Criu::dump`] for a move: once the images are complete, and while
    /// the tree is still frozen (its sockets in repair mode, the network
    /// lock held), `post_dump` runs with the images directory — it sends
    /// the images away and has them restored elsewhere. `Ok` completes the
    /// dump: CRIU kills the tree, whose sockets close without a packet.
    /// `Err(reason)` rolls it back: CRIU takes the sockets out of repair
    /// mode and the tree runs on here, its connections untouched, and the
    /// dump fails with [`Error::Aborted`]. (CRIU's "post-dump" action
    /// script, asked for over RPC with `notify_scripts`.)
    pub fn dump_then(
        &self,
        pid: i32,
        images: &Path,
        opts: &DumpOptions,
        post_dump: &mut PostDump<'_>,
    ) -> Result<Dumped, Error> {
        self.dump_inner(pid, images, opts, None, Some(post_dump), None)
    }

    /// [`Criu::dump_then`] (`pages`: `None`) or [`Criu::dump_lazily_then`]
    /// (`Some`: the socket CRIU's lazy page server serves on), with
    /// `pre_dump` ([`PreDump`]) run first, before CRIU freezes the tree.
    pub fn dump_steps(
        &self,
        pid: i32,
        images: &Path,
        opts: &DumpOptions,
        pages: Option<OwnedFd>,
        pre_dump: &mut PreDump<'_>,
        post_dump: &mut PostDump<'_>,
    ) -> Result<Dumped, Error> {
        self.dump_inner(pid, images, opts, Some(pre_dump), Some(post_dump), pages)
    }

    /// [`Criu::dump_then`] as a lazy dump (CRIU's `--lazy-pages`): the
    /// images hold no private anonymous memory (their pagemaps mark it
    /// lazy), so nothing of it is written inside the freeze. After
    /// `post_dump` (whatever its verdict) CRIU runs its page server on
    /// `pages` (one end of a stream socket pair; CRIU inherits it), the
    /// tree still frozen, until the other end hangs up; only then does it
    /// kill the tree (or resume it, after a refused step or a failed
    /// transfer), and this returns. The caller serves the memory itself,
    /// from `/proc/PID/mem` of the frozen tree, and closes its end once
    /// the destination has it all, or this never returns: CRIU runs with
    /// [`LAZY_UNPIPED_ENV`], so a CRIU that knows it neither captures the
    /// memory into its page pipes inside the freeze nor serves it.
    pub fn dump_lazily_then(
        &self,
        pid: i32,
        images: &Path,
        opts: &DumpOptions,
        pages: OwnedFd,
        post_dump: &mut PostDump<'_>,
    ) -> Result<Dumped, Error> {
        self.dump_inner(pid, images, opts, None, Some(post_dump), Some(pages))
    }

    fn dump_inner(
        &self,
        pid: i32,
        images: &Path,
        opts: &DumpOptions,
        mut pre_dump: Option<&mut PreDump<'_>>,
        mut post_dump: Option<&mut PostDump<'_>>,
        pages: Option<OwnedFd>,
    ) -> Result<Dumped, Error> {
        let dir = open_dir(images, "dump")?;
        let mut o = self.base_opts(&dir, "dump.log");
        // A lazy dump's page server serves on the inherited socket
        // (`ps-socket N`): CRIU's RPC has no field for it (its `ps` is a
        // TCP port on every address, and a page server that waits for a
        // connection nobody makes would hold a refused dump frozen), but
        // an RPC configuration file is applied after the request.
        let conf = match &pages {
            None => None,
            Some(fd) => {
                o.set_lazy_pages(true);
                let conf = ConfigFile::write(&format!("ps-socket {}\n", fd.as_raw_fd()))
                    .map_err(|source| Error::Io { op: "dump", source })?;
                o.set_config_file(conf.0.to_string_lossy().into_owned());
                Some(conf)
            }
        };
        o.set_pid(pid);
        o.set_leave_running(opts.leave_running);
        o.set_tcp_established(opts.tcp_established);
        o.set_shell_job(opts.shell_job);
        o.set_ext_unix_sk(opts.ext_unix_sk);
        o.set_file_locks(opts.file_locks);
        o.set_network_lock(opts.network_lock.rpc());
        o.set_notify_scripts(post_dump.is_some() || pre_dump.is_some());
        let mut refused: Option<String> = None;
        let mut on_notify = |script: &str| -> bool {
            if let (Some(step), "pre-dump") = (&mut pre_dump, script) {
                return match step() {
                    Ok(()) => true,
                    Err(reason) => {
                        refused = Some(reason);
                        false
                    }
                };
            }
            match (&mut post_dump, script) {
                (Some(step), "post-dump") => match step(images) {
                    Ok(()) => true,
                    Err(reason) => {
                        refused = Some(reason);
                        false
                    }
                },
                _ => true,
            }
        };
        let t = Instant::now();
        let resp = self.call_inheriting(
            "dump",
            rpc::Criu_req_type::DUMP,
            Some(o),
            Some(images),
            &mut on_notify,
            pages,
        );
        drop(conf);
        if let Some(reason) = refused {
            return Err(Error::Aborted { reason });
        }
        let resp = resp?;
        let elapsed = t.elapsed();
        if resp.type_() != rpc::Criu_req_type::DUMP {
            return Err(Error::Protocol {
                op: "dump",
                detail: format!("answered {:?} to a dump", resp.type_()),
            });
        }
        Ok(Dumped {
            elapsed,
            image_bytes: dir_bytes(images),
        })
    }

    /// Restores the tree dumped into `images`. Its root gets its old pid
    /// back; it runs detached from the caller (re-parented to init once CRIU
    /// exits).
    pub fn restore(&self, images: &Path, opts: &RestoreOptions) -> Result<Restored, Error> {
        let dir = open_dir(images, "restore")?;
        let mut o = self.base_opts(&dir, "restore.log");
        o.set_tcp_established(opts.tcp_established);
        o.set_shell_job(opts.shell_job);
        o.set_ext_unix_sk(opts.ext_unix_sk);
        o.set_file_locks(opts.file_locks);
        o.set_network_lock(opts.network_lock.rpc());
        o.set_lazy_pages(opts.lazy_pages);
        let t = Instant::now();
        let resp = self.call(
            "restore",
            rpc::Criu_req_type::RESTORE,
            Some(o),
            Some(images),
        )?;
        let elapsed = t.elapsed();
        let pid = resp
            .restore
            .as_ref()
            .map(|r| r.pid())
            .filter(|&p| p > 0)
            .ok_or_else(|| Error::Protocol {
                op: "restore",
                detail: "a successful restore without the restored pid".into(),
            })?;
        Ok(Restored { pid, elapsed })
    }

    /// Starts CRIU's lazy-pages daemon for a restore of `images` with
    /// [`RestoreOptions::lazy_pages`]: it takes the restored process's
    /// page faults and fetches each missing page over `page_server` (one
    /// end of a stream socket whose other end reaches the source's page
    /// server: CRIU's page-server protocol, carried as it is), and pages
    /// nobody asked for in the background. It ends, status 0, once every
    /// page is in place; any other end means pages are missing, and a
    /// process that then touches one would read zeros: the caller must
    /// kill the restored process. Its log is `lazy-pages.log` in `images`.
    pub fn lazy_pages_daemon(&self, images: &Path, page_server: OwnedFd) -> Result<Child, Error> {
        // The page-server socket is the daemon's stdin (named on the
        // command line), as `swrk`'s is.
        let mut cmd = command_in(self.netns.as_deref(), self.path.as_os_str());
        cmd.arg("lazy-pages")
            .arg("--page-server")
            .args(["--ps-socket", "0"])
            .arg("-D")
            .arg(images)
            .args(["-o", "lazy-pages.log"])
            .arg(format!("-v{}", self.log_level.number()))
            .stdin(Stdio::from(page_server))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut child = cmd.spawn().map_err(|source| Error::Spawn {
            path: self.path.clone(),
            source,
        })?;
        // The daemon makes its socket (`lazy-pages.socket` in `images`)
        // before it is ready for the restore, which connects to it.
        let sock = images.join("lazy-pages.socket");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !sock.exists() {
            let ended = child.try_wait().ok().flatten();
            if ended.is_some() || Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Failed {
                    op: "lazy-pages",
                    message: match ended {
                        Some(status) => {
                            format!("CRIU's lazy-pages daemon ended at start ({status})")
                        }
                        None => "CRIU's lazy-pages daemon did not start within 10 s".into(),
                    },
                    errno: None,
                    log: Some(images.join("lazy-pages.log")),
                    log_tail: tail(
                        &std::fs::read_to_string(images.join("lazy-pages.log")).unwrap_or_default(),
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(child)
    }

    /// Options common to dump and restore. `images` must stay open until
    /// the request is answered: CRIU opens the directory through the
    /// caller's descriptor (`/proc/<caller>/fd/<fd>`, the caller being the
    /// socket's peer), so nothing has to be inherited. (A plain path in
    /// `images_dir` fails in CRIU 4.1: it readlink()s the path.)
    fn base_opts(&self, images: &std::fs::File, log: &str) -> rpc::Criu_opts {
        let mut o = rpc::Criu_opts::new();
        o.set_images_dir_fd(images.as_raw_fd());
        o.set_log_file(log.to_owned());
        // An error quotes the log's error lines and its tail.
        o.set_log_level(self.log_level.number());
        o
    }

    fn query_version(&self) -> Result<Version, Error> {
        let resp = self.call("version", rpc::Criu_req_type::VERSION, None, None)?;
        let v = resp.version.as_ref().ok_or_else(|| Error::Protocol {
            op: "version",
            detail: "no version in the answer".into(),
        })?;
        let n = |x: i32| u32::try_from(x).unwrap_or(0);
        Ok(Version {
            major: n(v.major_number()),
            minor: n(v.minor_number()),
            sublevel: n(v.sublevel()),
        })
    }

    /// One request to a fresh `criu swrk`, and its final response.
    fn call(
        &self,
        op: &'static str,
        kind: rpc::Criu_req_type,
        opts: Option<rpc::Criu_opts>,
        images: Option<&Path>,
    ) -> Result<rpc::Criu_resp, Error> {
        self.call_notified(op, kind, opts, images, &mut |_| true)
    }

    /// [`Criu::call`], with `on_notify` answering each notification CRIU
    /// sends (its action scripts' names; `true` lets CRIU go on).
    fn call_notified(
        &self,
        op: &'static str,
        kind: rpc::Criu_req_type,
        opts: Option<rpc::Criu_opts>,
        images: Option<&Path>,
        on_notify: &mut dyn FnMut(&str) -> bool,
    ) -> Result<rpc::Criu_resp, Error> {
        self.call_inheriting(op, kind, opts, images, on_notify, None)
    }

    /// [`Criu::call_notified`], with `inherit` (if any) open in CRIU at
    /// the same descriptor number.
    fn call_inheriting(
        &self,
        op: &'static str,
        kind: rpc::Criu_req_type,
        opts: Option<rpc::Criu_opts>,
        images: Option<&Path>,
        on_notify: &mut dyn FnMut(&str) -> bool,
        inherit: Option<OwnedFd>,
    ) -> Result<rpc::Criu_resp, Error> {
        let (ours, theirs) = Socket::pair(Domain::UNIX, Type::SEQPACKET, None)
            .map_err(|source| Error::Io { op, source })?;
        // Survives exec (nsenter's, then CRIU's) where it is. Closed here
        // once CRIU has started, so that CRIU's is the only copy. (A
        // program started meanwhile by another thread of the caller would
        // inherit it too; a short-lived one only delays CRIU's end-of-file
        // until it exits.)
        let inherit = match inherit {
            None => None,
            Some(fd) => {
                let s = Socket::from(fd);
                s.set_cloexec(false)
                    .map_err(|source| Error::Io { op, source })?;
                Some(s)
            }
        };
        // CRIU's end is its stdin (fd 0, named on the command line): no
        // descriptor has to survive exec any other way.
        let mut cmd = command_in(self.netns.as_deref(), self.path.as_os_str());
        cmd.args(["swrk", "0"])
            .env(LAZY_UNPIPED_ENV, if inherit.is_some() { "1" } else { "0" })
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let spawned = cmd.spawn();
        // The command holds our copy of CRIU's end until dropped: closed
        // now, CRIU's death reads as end-of-file instead of a wait forever.
        drop(cmd);
        drop(inherit);
        let mut child = spawned.map_err(|source| Error::Spawn {
            path: self.path.clone(),
            source,
        })?;
        let result = exchange(op, kind, opts, &ours, on_notify);
        drop(ours);
        let (status, stderr) = reap(&mut child);
        let resp = match result {
            Ok(resp) => resp,
            Err(Error::Io { op, source }) if source.kind() == io::ErrorKind::UnexpectedEof => {
                let (log, log_text) = read_log(images, op);
                return Err(Error::Failed {
                    op,
                    message: format!(
                        "CRIU ended without an answer ({}){}",
                        status.map_or("not reaped".into(), |s| s.to_string()),
                        if stderr.is_empty() {
                            String::new()
                        } else {
                            format!("; it said: {stderr}")
                        }
                    ),
                    errno: None,
                    log,
                    log_tail: tail(&log_text),
                });
            }
            Err(Error::Io { op, source }) if !stderr.is_empty() => {
                return Err(Error::Io {
                    op,
                    source: io::Error::new(source.kind(), format!("{source}; CRIU said: {stderr}")),
                })
            }
            Err(e) => return Err(e),
        };
        if !resp.success() {
            let (log, log_text) = read_log(images, op);
            let log_tail = tail(&log_text);
            return Err(Error::Failed {
                op,
                message: headline(resp.cr_errmsg(), &log_text),
                errno: resp.cr_errno.filter(|&e| e > 0),
                log,
                log_tail,
            });
        }
        Ok(resp)
    }
}

/// A CRIU configuration file for one request, removed when dropped.
struct ConfigFile(PathBuf);

impl ConfigFile {
    fn write(text: &str) -> io::Result<ConfigFile> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "roam-criu-{}-{}.conf",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, text)?;
        Ok(ConfigFile(path))
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A network lock of roam's own: while held, every TCP packet to or from one
/// address is dropped in one network namespace (an nftables table with an
/// input and an output rule). Use it with [`NetworkLock::Skip`] around a dump
/// and around a restore.
///
/// Why not CRIU's own lock: CRIU's nftables lock adds one set element per
/// connection through libnftables, which aborts CRIU ("bit out of range 0 -
/// FD_SETSIZE on fd_set") once CRIU holds more than 1,024 descriptors, as it
/// does when it dumps a process with several hundred connections; its
/// iptables lock runs one iptables command per connection. One rule for the
/// whole address costs the same for ten connections or ten thousand, and it
/// also covers the gaps CRIU's lock leaves when a process moves between
/// hosts: from the moment the dumped sockets are gone until the address has
/// left the old host, and on the new host from the moment the address
/// arrives until the restored sockets exist — packets that would otherwise
/// draw resets are dropped, and TCP retransmits them.
///
/// The lock ends with the process that holds it, however it ends: its
/// table is owned (`flags owner`, Linux 5.12 and later) by an `nft -i`
/// child reading the holder's pipe, and the kernel deletes an owned table
/// when its owner's netlink socket closes. A holder killed outright leaves
/// no address locked for good.
#[derive(Debug)]
pub struct AddressLock {
    /// The nftables table (family `inet`) that holds the rules.
    table: String,
    /// The `nft -i` process whose netlink socket owns the table (`flags
    /// owner`): the kernel deletes an owned table when its owner's socket
    /// closes, so the lock ends with that process, whatever ends it. Its
    /// standard input is this lock's pipe: when the holder exits, even
    /// killed outright (SIGKILL, out of memory), the pipe closes, `nft`
    /// reads its end and exits, and nothing stays locked.
    keeper: Option<Keeper>,
}

/// How long `nft` may take to confirm a lock.
const LOCK_CONFIRM: Duration = Duration::from_secs(10);

/// A running `nft -i` that owns a lock's table.
#[derive(Debug)]
struct Keeper {
    child: Child,
    /// The process's commands; closing it ends the process (and the table).
    stdin: Option<std::process::ChildStdin>,
    /// What the process writes, line by line.
    lines: std::sync::mpsc::Receiver<NftLine>,
}

/// A line `nft -i` wrote, or the end of its output.
#[derive(Debug)]
enum NftLine {
    Out(String),
    Err(String),
    Closed,
}

impl Keeper {
    /// Starts `nft -i` in namespace `ns`, gives it `commands` (one per
    /// line; the first must create `table` with `flags owner`) and waits
    /// until the table lists, or fails with nft's error.
    fn start(ns: Option<&str>, table: &str, commands: &[String]) -> Result<Keeper, Error> {
        let lock_err = |detail: String| Error::Lock { detail };
        let mut child = command_in(ns, "nft".as_ref())
            .arg("-i")
            // Its history file (`$HOME/.nft.history`, written at exit) is
            // not the user's business: a home that does not exist.
            .env("HOME", "/nonexistent/roam")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| lock_err(format!("could not run nft: {e}")))?;
        let (tx, rx) = std::sync::mpsc::channel();
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        for (stream, is_err) in [
            (Box::new(out) as Box<dyn Read + Send>, false),
            (Box::new(err) as Box<dyn Read + Send>, true),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                use std::io::BufRead;
                // Reads to the end of nft's life, also once nobody listens
                // (the lock confirmed): a closed pipe would kill nft with
                // SIGPIPE at its next write, and its table with it.
                for line in io::BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    let _ = if is_err {
                        tx.send(NftLine::Err(line))
                    } else {
                        tx.send(NftLine::Out(line))
                    };
                }
                let _ = tx.send(NftLine::Closed);
            });
        }
        let mut keeper = Keeper {
            stdin: child.stdin.take(),
            child,
            lines: rx,
        };
        let mut script = commands.join("\n");
        script.push_str(&format!("\nlist table inet {table}\n"));
        let written = keeper
            .stdin
            .as_mut()
            .expect("piped")
            .write_all(script.as_bytes());
        let confirmed = match written {
            Err(e) => Err(format!("writing to nft: {e}")),
            Ok(()) => Self::confirm(&keeper.lines),
        };
        match confirmed {
            Ok(()) => Ok(keeper),
            Err(detail) => {
                keeper.end();
                Err(lock_err(detail))
            }
        }
    }

    /// Waits for the table's listing to end (a line `}`); nft's error (the
    /// message, the command and the caret under the fault) if one comes
    /// first.
    fn confirm(rx: &std::sync::mpsc::Receiver<NftLine>) -> Result<(), String> {
        let deadline = Instant::now() + LOCK_CONFIRM;
        let mut error: Vec<String> = Vec::new();
        let mut closed = 0;
        loop {
            let wait = if error.is_empty() {
                deadline.saturating_duration_since(Instant::now())
            } else {
                // The rest of the error's lines follow at once.
                Duration::from_millis(100)
            };
            match rx.recv_timeout(wait) {
                // The table's own closing brace, not a chain's (`\t}`).
                Ok(NftLine::Out(line)) if error.is_empty() && line.trim_end() == "}" => {
                    return Ok(())
                }
                Ok(NftLine::Out(_)) => {}
                Ok(NftLine::Err(line)) => {
                    if error.len() < 3 {
                        error.push(line.trim_end().to_string());
                    }
                }
                Ok(NftLine::Closed) => {
                    closed += 1;
                    if closed == 2 {
                        break;
                    }
                }
                Err(_) => break,
            }
        }
        if !error.is_empty() {
            return Err(format!("nft failed: {}", error.join(" | ")));
        }
        if closed == 2 {
            return Err("nft ended before the lock was in place".into());
        }
        Err(format!(
            "nft did not confirm the lock within {LOCK_CONFIRM:?}"
        ))
    }

    /// Deletes `table` through the running process, so that no process
    /// has to end before the lock is gone (10-13 ms on a loaded host,
    /// inside a move's hand-over): `delete`, then `list`, whose "No such
    /// file or directory" says the table is gone. The process is then
    /// ended and reaped on a thread of its own. If the delete is not
    /// confirmed within a second, the process is ended here instead (the
    /// kernel deletes the table it owns as its socket closes).
    fn release(mut self, table: &str) {
        // Lines left from the start (the listing's tail).
        while self.lines.try_recv().is_ok() {}
        let script = format!("delete table inet {table}\nlist table inet {table}\n");
        let written = self
            .stdin
            .as_mut()
            .is_some_and(|i| i.write_all(script.as_bytes()).is_ok());
        let deadline = Instant::now() + Duration::from_secs(1);
        let mut gone = false;
        while written && !gone {
            match self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(NftLine::Err(l)) if l.contains("No such file or directory") => gone = true,
                Ok(NftLine::Out(_) | NftLine::Err(_)) => {}
                Ok(NftLine::Closed) | Err(_) => break,
            }
        }
        if gone {
            std::thread::spawn(move || self.end());
        } else {
            self.end();
        }
    }

    /// Ends the process (its end of input, then SIGKILL if it lingers):
    /// the kernel deletes the table it owns as its socket closes.
    fn end(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => return,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    }
}

impl AddressLock {
    /// Drops TCP and UDP to and from `addr` in namespace `ns`
    /// (`/run/netns/NS`; the caller's own namespace if `None`) until
    /// released or dropped, or the calling process ends. (UDP too: a
    /// datagram that reached a frozen socket's queue would die with the
    /// dumped process.)
    pub fn new(ns: Option<&str>, addr: std::net::IpAddr) -> Result<AddressLock, Error> {
        let table = Self::table_name();
        let family = match addr {
            std::net::IpAddr::V4(_) => "ip",
            std::net::IpAddr::V6(_) => "ip6",
        };
        // Priority -150: before conntrack's and any filter table's hooks.
        let commands = vec![
            format!("add table inet {table} {{ flags owner; }}"),
            format!(
                "add chain inet {table} input {{ type filter hook input priority -150; policy accept; }}"
            ),
            format!("add rule inet {table} input {family} daddr {addr} meta l4proto {{ tcp, udp }} drop"),
            format!(
                "add chain inet {table} output {{ type filter hook output priority -150; policy accept; }}"
            ),
            format!("add rule inet {table} output {family} saddr {addr} meta l4proto {{ tcp, udp }} drop"),
        ];
        let keeper = Keeper::start(ns, &table, &commands)?;
        Ok(AddressLock {
            table,
            keeper: Some(keeper),
        })
    }

    /// Drops the packets of the TCP connections `conns` (each as its two
    /// ends, either way round) in namespace `ns` as they arrive, until
    /// released or dropped, or the calling process ends: for connections
    /// whose both ends are in this
    /// namespace (over loopback), which CRIU dumps and restores one end
    /// after the other. Dumping, a packet between its reads of the two ends
    /// leaves images that disagree (the sender counts as delivered bytes
    /// the receiver's image lacks, and the restored connection stalls for
    /// good). Restoring, CRIU sends a rebuilt socket's unsent data (and a
    /// window probe) the moment it is rebuilt: held back, they are
    /// retransmitted once both ends exist instead of drawing a reset from
    /// the end not yet rebuilt (a failed restore, "Can't restore not-sent
    /// send queue data ... Broken pipe") or landing in it half-built.
    /// Refused for an empty list.
    pub fn connections(
        ns: Option<&str>,
        conns: &[(std::net::SocketAddr, std::net::SocketAddr)],
    ) -> Result<AddressLock, Error> {
        if conns.is_empty() {
            return Err(Error::Lock {
                detail: "no connection to hold".into(),
            });
        }
        // Sets: the two ends of a connection in the tree both list it.
        let (mut v4, mut v6) = (
            std::collections::BTreeSet::new(),
            std::collections::BTreeSet::new(),
        );
        for (a, b) in conns {
            for (from, to) in [(a, b), (b, a)] {
                let elem = format!(
                    "{} . {} . {} . {}",
                    from.ip(),
                    from.port(),
                    to.ip(),
                    to.port()
                );
                match (from.ip(), to.ip()) {
                    (std::net::IpAddr::V4(_), std::net::IpAddr::V4(_)) => {
                        v4.insert(elem);
                    }
                    (std::net::IpAddr::V6(_), std::net::IpAddr::V6(_)) => {
                        v6.insert(elem);
                    }
                    _ => {
                        return Err(Error::Lock {
                            detail: format!("a connection between {a} and {b}: mixed families"),
                        })
                    }
                }
            }
        }
        let table = Self::table_name();
        // Input only: both ends are here, and a packet dropped on its way
        // in is lost to its sender, which retransmits it.
        let mut commands = vec![
            format!("add table inet {table} {{ flags owner; }}"),
            format!(
                "add chain inet {table} input {{ type filter hook input priority -150; policy accept; }}"
            ),
        ];
        for (family, elems) in [("ip", v4), ("ip6", v6)] {
            if !elems.is_empty() {
                commands.push(format!(
                    "add rule inet {table} input {family} saddr . tcp sport . {family} daddr . tcp dport {{ {} }} drop",
                    elems.into_iter().collect::<Vec<_>>().join(", ")
                ));
            }
        }
        let keeper = Keeper::start(ns, &table, &commands)?;
        Ok(AddressLock {
            table,
            keeper: Some(keeper),
        })
    }

    /// A table name no other lock of this process has.
    fn table_name() -> String {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        format!(
            "roam_lock_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// The nftables table (family `inet`) that holds the lock's rules.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Lifts the lock: the table is deleted (through its `nft`, which then
    /// ends; or, failing that, as that `nft` ends).
    pub fn release(mut self) -> Result<(), Error> {
        if let Some(k) = self.keeper.take() {
            k.release(&self.table);
        }
        Ok(())
    }
}

impl Drop for AddressLock {
    fn drop(&mut self) {
        if let Some(mut k) = self.keeper.take() {
            k.end();
        }
    }
}

/// A command running `program` with only its network namespace changed to
/// `ns` (`nsenter --net=/run/netns/NS`), or as is when `ns` is `None`.
fn command_in(ns: Option<&str>, program: &std::ffi::OsStr) -> Command {
    match ns {
        Some(ns) => {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net=/run/netns/{ns}"))
                .arg("--")
                .arg(program);
            c
        }
        None => Command::new(program),
    }
}

/// Sends the request and reads responses until the final one. Each
/// notification (they come only when asked for with `notify_scripts`) is
/// answered with what `on_notify` says of it; the time it takes does not
/// count against the request's own time limit.
fn exchange(
    op: &'static str,
    kind: rpc::Criu_req_type,
    opts: Option<rpc::Criu_opts>,
    sock: &Socket,
    on_notify: &mut dyn FnMut(&str) -> bool,
) -> Result<rpc::Criu_resp, Error> {
    let io_err = |source| Error::Io { op, source };
    let mut req = rpc::Criu_req::new();
    req.set_type(kind);
    if let Some(o) = opts {
        req.opts = MessageField::some(o);
    }
    let bytes = req.write_to_bytes().map_err(|e| Error::Protocol {
        op,
        detail: format!("could not encode the request: {e}"),
    })?;
    sock.set_write_timeout(Some(RPC_TIMEOUT)).map_err(io_err)?;
    sock.set_read_timeout(Some(RPC_TIMEOUT)).map_err(io_err)?;
    (&*sock).write_all(&bytes).map_err(io_err)?;
    let mut deadline = Instant::now() + RPC_TIMEOUT;
    // One message per read (SOCK_SEQPACKET); CRIU's responses are small.
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match (&*sock).read(&mut buf) {
            Ok(0) => {
                return Err(io_err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "CRIU closed the connection without an answer",
                )))
            }
            Ok(n) => n,
            // A signal for another part of the caller (a child's exit, in a
            // program that runs many) is no reason to give up on CRIU: read
            // again, within the same overall time.
            Err(e) if e.kind() == io::ErrorKind::Interrupted && Instant::now() < deadline => {
                continue
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                return Err(Error::Timeout { op })
            }
            Err(e) => return Err(io_err(e)),
        };
        let resp = rpc::Criu_resp::parse_from_bytes(&buf[..n]).map_err(|e| Error::Protocol {
            op,
            detail: format!("undecodable response ({n} bytes): {e}"),
        })?;
        if resp.type_() == rpc::Criu_req_type::NOTIFY {
            let script = resp.notify.as_ref().map_or("", |n| n.script());
            let go_on = on_notify(script);
            deadline = Instant::now() + RPC_TIMEOUT;
            let mut ack = rpc::Criu_req::new();
            ack.set_type(rpc::Criu_req_type::NOTIFY);
            ack.set_notify_success(go_on);
            let b = ack.write_to_bytes().map_err(|e| Error::Protocol {
                op,
                detail: format!("could not encode a notification's answer: {e}"),
            })?;
            (&*sock).write_all(&b).map_err(io_err)?;
            continue;
        }
        return Ok(resp);
    }
}

/// Waits for `criu swrk` (it exits once its socket closes; killed if it
/// does not within a few seconds) and returns how it ended and what it
/// wrote to stderr.
fn reap(child: &mut Child) -> (Option<std::process::ExitStatus>, String) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                let _ = child.kill();
                break child.wait().ok();
            }
        }
    };
    let mut err = String::new();
    if let Some(mut s) = child.stderr.take() {
        let _ = s.read_to_string(&mut err);
    }
    (status, err.trim().to_owned())
}

/// The images directory, opened for CRIU to reach through `/proc`.
fn open_dir(dir: &Path, op: &'static str) -> Result<std::fs::File, Error> {
    std::fs::File::open(dir).map_err(|e| Error::Io {
        op,
        source: io::Error::new(e.kind(), format!("images directory {}: {e}", dir.display())),
    })
}

/// Where CRIU's log of `op` is (in the images directory, when there is one)
/// and its text (empty if unreadable).
fn read_log(images: Option<&Path>, op: &str) -> (Option<PathBuf>, String) {
    let log = images.map(|d| d.join(format!("{op}.log")));
    let text = log
        .as_deref()
        .and_then(|l| std::fs::read(l).ok())
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    (log, text)
}

/// CRIU errors that do not make an operation fail: CRIU logs them as errors
/// and reports the first error it logged as the request's message, which
/// would then hide the real cause. Raising its descriptor limit fails
/// without CAP_SYS_RESOURCE, and CRIU carries on with the limit it has.
const HARMLESS: &[&str] = &["rlimit: Can't setup RLIMIT_NOFILE"];

/// The `Error` lines of CRIU's log that are not [`HARMLESS`].
fn error_lines(log: &str) -> impl Iterator<Item = &str> {
    log.lines()
        .filter(|l| l.contains("Error (") && !HARMLESS.iter().any(|h| l.contains(h)))
}

/// The failure's one-line cause: CRIU's message, unless that is a
/// [`HARMLESS`] error, then the first real `Error` line of the log (without
/// its timestamp and pid).
fn headline(cr_errmsg: &str, log: &str) -> String {
    let msg = cr_errmsg.trim();
    if !msg.is_empty() && !HARMLESS.iter().any(|h| msg.contains(h)) {
        return msg.to_owned();
    }
    error_lines(log)
        .next()
        .map(|l| l[l.find("Error (").unwrap_or(0)..].trim().to_owned())
        .unwrap_or_else(|| msg.to_owned())
}

/// What an error quotes from CRIU's log: its real `Error` lines (the first
/// [`LOG_TAIL_LINES`]; a failure's cause is usually the first of them), then
/// its last lines, up to [`LOG_TAIL_LINES`] in all.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    let mut quoted: Vec<&str> = error_lines(log).take(LOG_TAIL_LINES).collect();
    let room = LOG_TAIL_LINES.saturating_sub(quoted.len()).max(2);
    let last = &lines[lines.len().saturating_sub(room)..];
    if !quoted.is_empty() && !last.is_empty() {
        quoted.push("...");
    }
    quoted.extend(last.iter().filter(|l| !l.contains("Error (")));
    quoted.join("\n")
}

/// Whether a file of an images directory is one of CRIU's logs (the
/// `dump.log`, `restore.log`, `lazy-pages.log` roam asks for), not an image.
pub fn is_log(name: &str) -> bool {
    name.ends_with(".log")
}

/// Total size of the regular files directly in `dir`, CRIU's logs left out.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter(|e| !is_log(&e.file_name().to_string_lossy()))
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// `name` in one of `PATH`'s directories.
fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_bytes_leave_the_logs_out() {
        let dir = tempfile::tempdir().expect("dir");
        std::fs::write(dir.path().join("pstree.img"), [0u8; 10]).expect("image");
        std::fs::write(dir.path().join("pages-1.img"), [0u8; 32]).expect("image");
        std::fs::write(dir.path().join("dump.log"), [0u8; 1000]).expect("log");
        std::fs::create_dir(dir.path().join("sub")).expect("subdirectory");
        assert_eq!(dir_bytes(dir.path()), 42);
    }

    #[test]
    fn versions_order_by_major_minor_then_sublevel() {
        let v = |major, minor, sublevel| Version {
            major,
            minor,
            sublevel,
        };
        assert!(v(3, 17, 0) < MIN_VERSION);
        assert!(v(4, 0, 9) < MIN_VERSION);
        assert!(v(4, 1, 0) >= MIN_VERSION);
        assert!(v(4, 1, 1) > MIN_VERSION);
        assert!(v(5, 0, 0) > MIN_VERSION);
        assert_eq!(v(4, 1, 1).to_string(), "4.1.1");
    }

    #[test]
    fn a_missing_binary_is_refused_with_its_path() {
        let e = Criu::at(Path::new("/nonexistent/criu")).unwrap_err();
        assert!(matches!(e, Error::Spawn { .. }), "{e:?}");
        assert!(e.to_string().contains("/nonexistent/criu"), "{e}");
    }

    #[test]
    fn a_failure_names_the_real_cause_and_quotes_the_log() {
        let mut lines: Vec<String> = (0..30).map(|i| format!("(00.{i:06}) line {i}")).collect();
        lines[3] = "(00.000003) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE \
                    for self: Operation not permitted"
            .into();
        lines[9] = " 30443: Error (soccr/soccr.c:499): Can't bind inet socket back: \
                    Cannot assign requested address"
            .into();
        let log = lines.join("\n");
        let e = Error::Failed {
            op: "restore",
            message: headline(&lines[3], &log),
            errno: Some(3),
            log: Some(PathBuf::from("/images/restore.log")),
            log_tail: tail(&log),
        };
        let s = e.to_string();
        assert!(
            s.starts_with(
                "criu restore failed: Error (soccr/soccr.c:499): Can't bind inet socket back: \
                 Cannot assign requested address (No such process"
            ),
            "the real cause heads the message, not CRIU's harmless first error: {s}"
        );
        assert!(s.contains("/images/restore.log"), "{s}");
        assert!(!s.contains("RLIMIT_NOFILE"), "{s}");
        assert!(s.contains("line 29") && s.contains("line 19"), "{s}");
        assert!(!s.contains("line 18"), "only the last lines: {s}");
        // A message of CRIU's own that is not harmless stays as it is.
        assert_eq!(headline("Dumping FAILED.", &log), "Dumping FAILED.");
    }
}
