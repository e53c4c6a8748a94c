//! `roam suspend --vm` / `roam resume --vm`: a QEMU virtual machine as an
//! Internet Suspend/Resume environment, the copy-in policy of the paper.
//!
//! Suspend: over the VM's QMP socket, `stop` the guest, then write its
//! memory and device state with QEMU's own migration stream (`migrate` to
//! `exec:cat > FILE`); the disk images (flushed by the stop) and that
//! memory image go into the store as one version, and the stopped VM is
//! told to `quit` once the version is written (`cont`, if anything failed:
//! the VM then runs on where it was).
//!
//! Resume: the version's images are written into a directory (every chunk
//! verified, as `roam resume` does), then the user's QEMU command is started
//! with `-incoming exec:cat DIR/vm-memory` and a private QMP socket; once
//! QEMU has loaded the memory, `cont` lets the guest run on from the
//! instruction it was stopped at. `roam resume` then waits for QEMU and
//! exits with its status.
//!
//! With `--demand-fetch`, [`nbd_drives`] points the command's `-drive
//! file=DIR/<image>` options at roam's NBD sockets instead (the `demand`
//! module serves them) and only the memory image is copied in first.
//!
//! Non-goals here: live (pre-copy) migration: the guest is stopped for the
//! whole suspend. QMP is a line of JSON per message; this client sends one command
//! at a time, skips events and bounds every wait in time.

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// The image name of a VM's memory (QEMU's migration stream) in a version.
pub(crate) const VM_MEMORY_IMAGE: &str = "vm-memory";

/// The image name of a VM's guest RAM as a flat file (lazy memory: RAM in a
/// `memory-backend-file` with `share=on`), chunked like a disk.
pub(crate) const VM_RAM_IMAGE: &str = "vm-ram";

/// The image name of a lazy-memory VM's device state: QEMU's migration
/// stream written with `x-ignore-shared`, so without the RAM of
/// [`VM_RAM_IMAGE`]. A version holds either this pair or [`VM_MEMORY_IMAGE`].
pub(crate) const VM_DEVSTATE_IMAGE: &str = "vm-devstate";

/// The image names `roam suspend --vm` gives the VM's own state.
pub(crate) const VM_IMAGES: [&str; 3] = [VM_MEMORY_IMAGE, VM_RAM_IMAGE, VM_DEVSTATE_IMAGE];

/// Longest a single QMP reply may take (10 s).
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest QEMU may take to write or load a memory image (10 min: a few GB
/// at disk speed).
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(600);

/// Interval between two polls of a migration's status (50 ms).
const POLL_EVERY: Duration = Duration::from_millis(50);

/// Longest one QMP line may be (1 MiB): a reply larger than that is not QEMU.
const MAX_LINE: usize = 1 << 20;

/// A failure talking to QEMU, worded for the user.
#[derive(Debug)]
pub(crate) struct VmError(pub(crate) String);

impl std::fmt::Display for VmError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A QMP connection in command mode.
pub(crate) struct Qmp {
    /// Replies and events, a line each.
    reader: BufReader<tokio::net::unix::OwnedReadHalf>,
    /// Commands.
    writer: tokio::net::unix::OwnedWriteHalf,
    /// The socket's path, for messages.
    path: PathBuf,
}

impl Qmp {
    /// Connects to the QMP socket at `path` and enters command mode.
    pub(crate) async fn connect(path: &Path) -> Result<Qmp, VmError> {
        let shown = path.display();
        let stream = tokio::time::timeout(REPLY_TIMEOUT, UnixStream::connect(path))
            .await
            .map_err(|_| VmError(format!("QMP socket {shown}: no answer in 10 s")))?
            .map_err(|e| {
                VmError(format!(
                    "cannot connect to QEMU's QMP socket {shown}: {e} (start QEMU with \
                     -qmp unix:{shown},server=on,wait=off)"
                ))
            })?;
        let (read, writer) = stream.into_split();
        let mut qmp = Qmp {
            reader: BufReader::new(read),
            writer,
            path: path.to_owned(),
        };
        let greeting = qmp.read_message().await?;
        if greeting.get("QMP").is_none() {
            return Err(VmError(format!(
                "{shown} is not a QMP socket (its first message was {greeting})"
            )));
        }
        qmp.execute("qmp_capabilities", json!({})).await?;
        Ok(qmp)
    }

    /// One JSON message from QEMU, within [`REPLY_TIMEOUT`].
    async fn read_message(&mut self) -> Result<Value, VmError> {
        let shown = self.path.display();
        let mut line = Vec::new();
        let read = tokio::time::timeout(REPLY_TIMEOUT, async {
            let mut limited = (&mut self.reader).take(MAX_LINE as u64 + 1);
            limited.read_until(b'\n', &mut line).await
        })
        .await
        .map_err(|_| VmError(format!("QEMU ({shown}) did not answer within 10 s")))?
        .map_err(|e| VmError(format!("QMP socket {shown}: {e}")))?;
        if read == 0 {
            return Err(VmError(format!(
                "QEMU closed its QMP socket {shown} (did it exit?)"
            )));
        }
        if line.len() > MAX_LINE {
            return Err(VmError(format!(
                "QMP socket {shown}: a message over 1 MiB (not QEMU?)"
            )));
        }
        serde_json::from_slice(&line).map_err(|e| {
            VmError(format!(
                "QMP socket {shown}: not JSON ({e}): {}",
                String::from_utf8_lossy(&line).trim_end()
            ))
        })
    }

    /// Runs `command` and returns its `return` value; a QMP error names it.
    pub(crate) async fn execute(&mut self, command: &str, args: Value) -> Result<Value, VmError> {
        let shown = self.path.display().to_string();
        let mut msg = json!({ "execute": command, "arguments": args }).to_string();
        msg.push('\n');
        tokio::time::timeout(REPLY_TIMEOUT, self.writer.write_all(msg.as_bytes()))
            .await
            .map_err(|_| VmError(format!("QMP socket {shown}: write timed out")))?
            .map_err(|e| VmError(format!("QMP socket {shown}: {e}")))?;
        // Events may come before the reply; a bounded number is skipped.
        for _ in 0..1000 {
            let reply = self.read_message().await?;
            if reply.get("event").is_some() {
                continue;
            }
            if let Some(ret) = reply.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = reply.get("error") {
                let desc = err
                    .get("desc")
                    .and_then(Value::as_str)
                    .unwrap_or("no description");
                return Err(VmError(format!("QEMU refused {command}: {desc}")));
            }
            return Err(VmError(format!(
                "QMP socket {shown}: unexpected message {reply}"
            )));
        }
        Err(VmError(format!(
            "QMP socket {shown}: no reply to {command} among 1000 events"
        )))
    }

    /// The run state (`running`, `paused`, `inmigrate`, ...).
    pub(crate) async fn status(&mut self) -> Result<String, VmError> {
        let ret = self.execute("query-status", json!({})).await?;
        Ok(ret
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or("unknown")
            .to_owned())
    }

    /// The file of the VM's shared file-backed guest RAM, if it has one:
    /// the one `memory-backend-file` with `share=on` (`query-memdev`, then
    /// `qom-get /objects/<id> mem-path`). Two such backends are refused:
    /// `x-ignore-shared` would leave both out of the stream and roam stores one.
    pub(crate) async fn shared_ram(&mut self) -> Result<Option<PathBuf>, VmError> {
        let memdevs = self.execute("query-memdev", json!({})).await?;
        let mut found: Vec<PathBuf> = Vec::new();
        for dev in memdevs.as_array().map(Vec::as_slice).unwrap_or_default() {
            let shared = dev.get("share").and_then(Value::as_bool) == Some(true);
            let Some(id) = dev.get("id").and_then(Value::as_str).filter(|_| shared) else {
                continue;
            };
            // Only a memory-backend-file has mem-path (memfd has none).
            let path = json!({ "path": format!("/objects/{id}"), "property": "mem-path" });
            if let Ok(Value::String(p)) = self.execute("qom-get", path).await {
                found.push(PathBuf::from(p));
            }
        }
        if found.len() > 1 {
            return Err(VmError(format!(
                "the VM has {} shared memory-backend-file objects; roam suspends a VM with at                  most one (its RAM, -machine memory-backend=ID)",
                found.len()
            )));
        }
        Ok(found.pop())
    }

    /// Stops the guest and writes its memory and device state to `file`
    /// (created here with mode 0600); with `ignore_shared`, QEMU's
    /// `x-ignore-shared` leaves shared file-backed RAM out of `file` (device
    /// state only: the RAM is its own file). Returns the time it took.
    pub(crate) async fn stop_and_save(
        &mut self,
        file: &Path,
        ignore_shared: bool,
    ) -> Result<Duration, VmError> {
        let start = Instant::now();
        let Some(file_str) = file.to_str() else {
            return Err(VmError(format!(
                "{} is not UTF-8: QEMU cannot be told to write there",
                file.display()
            )));
        };
        // Made here, private, so `cat >` only fills it.
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(file)
            .map_err(|e| VmError(format!("cannot create {}: {e}", file.display())))?;
        self.execute("stop", json!({})).await?;
        if ignore_shared {
            self.execute(
                "migrate-set-capabilities",
                json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": true }] }),
            )
            .await?;
        }
        // QEMU throttles migration to 32 MiB/s by default; a stopped guest's
        // state goes to a local file as fast as the disk takes it.
        self.execute(
            "migrate-set-parameters",
            json!({ "max-bandwidth": 1u64 << 40 }),
        )
        .await?;
        let uri = format!("exec:cat > {}", shell_quote(file_str));
        self.execute("migrate", json!({ "uri": uri })).await?;
        let deadline = start + MIGRATION_TIMEOUT;
        loop {
            let ret = self.execute("query-migrate", json!({})).await?;
            match ret.get("status").and_then(Value::as_str) {
                Some("completed") => return Ok(start.elapsed()),
                Some("failed" | "cancelled") => {
                    let why = ret
                        .get("error-desc")
                        .and_then(Value::as_str)
                        .unwrap_or("no reason given");
                    return Err(VmError(format!(
                        "QEMU could not write its memory image to {}: {why}",
                        file.display()
                    )));
                }
                _ => {}
            }
            if Instant::now() > deadline {
                let _ = self.execute("migrate_cancel", json!({})).await;
                return Err(VmError(format!(
                    "QEMU did not finish writing its memory image within {} s",
                    MIGRATION_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }

    /// Waits until an incoming migration is loaded, then lets the guest
    /// run. `alive` says whether QEMU is still running.
    pub(crate) async fn finish_incoming(
        &mut self,
        mut alive: impl FnMut() -> bool,
    ) -> Result<(), VmError> {
        let deadline = Instant::now() + MIGRATION_TIMEOUT;
        loop {
            match self.status().await?.as_str() {
                "inmigrate" => {}
                "running" => return Ok(()),
                "paused" | "postmigrate" | "prelaunch" => {
                    self.execute("cont", json!({})).await?;
                    return Ok(());
                }
                other => {
                    return Err(VmError(format!(
                        "QEMU is in state {other} after loading the memory image, not paused or \
                         running"
                    )))
                }
            }
            if !alive() {
                return Err(VmError(
                    "QEMU exited while loading the memory image (its message is above)".into(),
                ));
            }
            if Instant::now() > deadline {
                return Err(VmError(format!(
                    "QEMU did not load the memory image within {} s",
                    MIGRATION_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }
}

/// `s` quoted for `/bin/sh` (QEMU runs `exec:` URIs through it).
pub(crate) fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Where `roam suspend --vm` has QEMU write the memory image: beside the
/// first disk image (the same file system, which has room for images),
/// under a hidden name of this process.
pub(crate) fn memory_file_for(first_disk: Option<&Path>) -> PathBuf {
    let dir = first_disk
        .and_then(Path::parent)
        .filter(|d| !d.as_os_str().is_empty())
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    dir.join(format!(
        ".{VM_MEMORY_IMAGE}.roam-suspend.{}",
        std::process::id()
    ))
}

/// Removes a file when dropped (the memory image of a suspend).
pub(crate) struct RemoveOnDrop(pub(crate) PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The command that starts `program` (QEMU) so that it is killed if roam
/// is (SIGKILL, out of memory: `kill_on_drop` never runs then, and an
/// orphaned QEMU would run on without its disks or lazy memory): through
/// util-linux's `setpriv --pdeathsig KILL`, which sets `PR_SET_PDEATHSIG`
/// and executes QEMU in the same process (same pid). roam-cli has no
/// `unsafe`, which a `pre_exec` setting it here would need.
///
/// Between the fork and setpriv's `prctl` roam may already be dead; the
/// signal is then never sent. So setpriv executes `/bin/sh -c`, which
/// executes QEMU (same pid still) only if its parent is still roam
/// ([`GUARD`]): after the `prctl`, either roam is the parent and its death
/// will kill QEMU, or it is not and QEMU is never started.
///
/// The signal comes when the *thread* that forked QEMU ends, not the
/// process. Only the main thread lives exactly as long as roam: a tokio
/// worker can hand its role to a new thread (`block_in_place`) and end
/// when idle, and a blocking-pool thread ends after ten idle seconds,
/// either of which would kill a healthy QEMU. So the death signal is set
/// only when the caller runs on the main thread (`roam resume` awaits QEMU
/// in its runtime's `block_on`); elsewhere, and without `setpriv`, a
/// warning says QEMU will outlive a killed roam. A `program` that does not
/// exist or is not executable is refused by name before anything starts.
fn dies_with_roam(program: &str) -> Result<tokio::process::Command, VmError> {
    let (cmd, warning) = qemu_command(
        program,
        std::process::id(),
        on_main_thread(),
        std::env::var_os("PATH").as_deref(),
    )?;
    if let Some(w) = warning {
        eprintln!("roam: warning: {w}");
    }
    Ok(tokio::process::Command::from(cmd))
}

/// The script setpriv executes between its `prctl` and QEMU: `$0` is
/// roam's pid, the arguments QEMU's command line. QEMU is executed only if
/// the shell's parent is still roam, so a roam killed before the `prctl`
/// leaves nothing behind (the shell exits 1 with no one to see it).
const GUARD: &str = r#"[ "$PPID" = "$0" ] && exec "$@""#;

/// Whether the calling thread is the process's main thread (its thread id
/// is the process id), the one thread that ends only with roam.
fn on_main_thread() -> bool {
    nix::unistd::gettid() == nix::unistd::getpid()
}

/// The command of [`dies_with_roam`], for a roam of pid `roam` whose caller
/// is (`main_thread`) or is not on the main thread, with `path` as PATH;
/// and the warning to print, if QEMU will not die with roam. Arguments are
/// added by the caller after the returned command's own.
fn qemu_command(
    program: &str,
    roam: u32,
    main_thread: bool,
    path: Option<&std::ffi::OsStr>,
) -> Result<(std::process::Command, Option<String>), VmError> {
    use std::os::unix::fs::PermissionsExt as _;
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    let found = |p: &Path| p.is_file();
    let search = |name: &str, ok: &dyn Fn(&Path) -> bool| {
        path.and_then(|path| {
            std::env::split_paths(path)
                .map(|dir| dir.join(name))
                .find(|p| ok(p))
        })
    };
    if program.contains('/') {
        let p = Path::new(program);
        if !found(p) {
            return Err(VmError(format!(
                "cannot start {program}: no such program (give QEMU's path or put it on PATH)"
            )));
        }
        if !executable(p) {
            return Err(VmError(format!(
                "cannot start {program}: it is not executable (chmod +x, or give QEMU's path)"
            )));
        }
    } else if search(program, &executable).is_none() {
        return Err(VmError(match search(program, &found) {
            Some(p) => format!("cannot start {program}: {} is not executable", p.display()),
            None => {
                format!(
                    "cannot start {program}: no such program (give QEMU's path or put it on PATH)"
                )
            }
        }));
    }
    let unguarded = |why: String| Ok((std::process::Command::new(program), Some(why)));
    if search("setpriv", &executable).is_none() {
        return unguarded(format!(
            "setpriv (util-linux) not found: {program} will outlive roam if roam is killed outright"
        ));
    }
    if !main_thread {
        return unguarded(format!(
            "{program} is started off roam's main thread, so it is not tied to roam's life: it \
             will outlive roam if roam is killed outright"
        ));
    }
    let mut c = std::process::Command::new("setpriv");
    c.args(["--pdeathsig", "KILL", "--", "/bin/sh", "-c", GUARD])
        .arg(roam.to_string())
        .arg(program);
    Ok((c, None))
}

/// A point in [`run_incoming`] a caller may act on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Incoming {
    /// QEMU was started (it loads the memory image next).
    Started,
    /// The memory image is loaded and the guest runs.
    Running,
}

/// Starts `qemu` (program and arguments) loading `memory` and lets the
/// guest run; then waits for QEMU and returns its exit status. SIGINT and
/// SIGTERM are passed on to QEMU. `on` is called when QEMU has started and
/// when the guest runs (`roam resume --demand-fetch` counts its chunks
/// there and starts the background fill). With `ignore_shared` (`memory`
/// is a lazy-memory VM's device state), QEMU starts with `-incoming defer`
/// and is told over QMP to set `x-ignore-shared` and then load `memory`:
/// the capability must be on before the stream is read.
pub(crate) async fn run_incoming(
    qemu: &[String],
    dir: &Path,
    (memory, ignore_shared): (&Path, bool),
    mut report: impl FnMut(&str),
    mut on: impl FnMut(Incoming),
) -> Result<i32, VmError> {
    let (program, args) = qemu
        .split_first()
        .ok_or_else(|| VmError("--vm needs the QEMU command after `--`".into()))?;
    let Some(memory_str) = memory.to_str() else {
        return Err(VmError(format!("{} is not UTF-8", memory.display())));
    };
    let sock = dir.join(format!(".roam-resume-qmp.{}", std::process::id()));
    let _ = std::fs::remove_file(&sock);
    let _sock_guard = RemoveOnDrop(sock.clone());
    let uri = format!("exec:cat {}", shell_quote(memory_str));
    let mut child = dies_with_roam(program)?
        .args(args)
        .arg("-incoming")
        .arg(if ignore_shared { "defer" } else { uri.as_str() })
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", sock.display()))
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| VmError(format!("cannot start {program}: {e}")))?;
    let pid = child.id().unwrap_or(0);
    on(Incoming::Started);
    report(&format!(
        "started {program} (pid {pid}), loading the memory image"
    ));
    let start = Instant::now();
    // QEMU makes the socket once it has parsed its options.
    let connect_deadline = start + REPLY_TIMEOUT;
    let mut qmp = loop {
        if let Some(status) = child.try_wait().map_err(|e| VmError(e.to_string()))? {
            return Err(VmError(format!(
                "{program} exited ({status}) before it loaded the memory image (its message is \
                 above)"
            )));
        }
        if sock.exists() {
            match Qmp::connect(&sock).await {
                Ok(q) => break q,
                Err(e) if Instant::now() > connect_deadline => return Err(e),
                Err(_) => {}
            }
        } else if Instant::now() > connect_deadline {
            return Err(VmError(format!("{program} made no QMP socket within 10 s")));
        }
        tokio::time::sleep(POLL_EVERY).await;
    };
    let _ = std::fs::remove_file(&sock);
    let loaded = async {
        if ignore_shared {
            qmp.execute(
                "migrate-set-capabilities",
                json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": true }] }),
            )
            .await?;
            qmp.execute("migrate-incoming", json!({ "uri": uri }))
                .await?;
        }
        qmp.finish_incoming(|| matches!(child.try_wait(), Ok(None)))
            .await
    };
    if let Err(e) = loaded.await {
        // A QEMU that died while loading (with lazy memory: QEMU touches
        // guest RAM then, and a page roam refused is SIGBUS) is said so.
        return Err(
            match tokio::time::timeout(Duration::from_secs(2), child.wait()).await {
                Ok(Ok(status)) => VmError(format!(
                    "{program} exited ({status}) while loading the memory image: see the lines \
                     above (QEMU's message, or a chunk roam refused)"
                )),
                _ => e,
            },
        );
    }
    on(Incoming::Running);
    report(&format!(
        "the guest runs (memory loaded in {} ms); roam waits for QEMU to exit",
        start.elapsed().as_millis()
    ));
    let mut signal = std::pin::pin!(crate::signals::interrupt_or_terminate());
    let status = loop {
        tokio::select! {
            s = child.wait() => break s.map_err(|e| VmError(format!("waiting for QEMU: {e}")))?,
            _ = &mut signal => pass_on(pid),
        }
    };
    drop(qmp);
    Ok(status.code().unwrap_or(1))
}

/// Rewrites the `-drive file=DIR/<image>,...` options of `qemu` whose file
/// is one of `images` in `dir` so that QEMU opens the image over NBD from
/// `socket_for(image)` instead (`file.driver=nbd,file.server.type=unix,
/// file.server.path=SOCK,file.export=IMAGE`; every other suboption, such as
/// `format=raw,if=virtio`, is kept). Returns the new command and the images
/// it now takes from a socket, in order of first use.
pub(crate) fn nbd_drives(
    qemu: &[String],
    dir: &Path,
    images: &[&str],
    socket_for: impl Fn(&str) -> PathBuf,
) -> (Vec<String>, Vec<String>) {
    let canonical_dir = std::fs::canonicalize(dir).ok();
    let is_image = |value: &str| -> Option<&str> {
        let path = Path::new(value);
        let name = path.file_name()?.to_str()?;
        let image = images.iter().find(|i| **i == name)?;
        let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
        let same_dir = parent == Some(dir)
            || (canonical_dir.is_some()
                && std::fs::canonicalize(parent.unwrap_or(Path::new("."))).ok() == canonical_dir);
        same_dir.then_some(*image)
    };
    let mut out = Vec::with_capacity(qemu.len());
    let mut served: Vec<String> = Vec::new();
    let mut next_is_drive = false;
    for arg in qemu {
        if !std::mem::take(&mut next_is_drive) {
            next_is_drive = arg == "-drive" || arg == "--drive";
            out.push(arg.clone());
            continue;
        }
        let mut parts = split_suboptions(arg);
        let found = parts
            .iter()
            .position(|p| p.strip_prefix("file=").and_then(&is_image).is_some());
        let Some(at) = found else {
            out.push(arg.clone());
            continue;
        };
        let image = is_image(&parts[at]["file=".len()..])
            .unwrap_or_default()
            .to_owned();
        let sock = socket_for(&image);
        parts.splice(
            at..=at,
            [
                "file.driver=nbd".to_owned(),
                "file.server.type=unix".to_owned(),
                format!("file.server.path={}", sock.display()),
                format!("file.export={image}"),
            ],
        );
        out.push(join_suboptions(&parts));
        if !served.contains(&image) {
            served.push(image);
        }
    }
    (out, served)
}

/// Checks that `qemu` maps the guest RAM from `DIR/vm-ram` (an `-object
/// memory-backend-file,...,mem-path=DIR/vm-ram,share=on`), as a version of
/// a lazy-memory VM needs, and returns the command with that `mem-path`
/// pointed at `mem_path` if given (the FUSE file of a demand-fetch resume).
/// The error says what to write.
pub(crate) fn ram_backend(
    qemu: &[String],
    dir: &Path,
    mem_path: Option<&Path>,
) -> Result<Vec<String>, VmError> {
    let canonical_dir = std::fs::canonicalize(dir).ok();
    let is_ram = |value: &str| -> bool {
        let path = Path::new(value);
        let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
        path.file_name() == Some(std::ffi::OsStr::new(VM_RAM_IMAGE))
            && (parent == Some(dir)
                || (canonical_dir.is_some()
                    && std::fs::canonicalize(parent.unwrap_or(Path::new("."))).ok()
                        == canonical_dir))
    };
    let mut out = Vec::with_capacity(qemu.len());
    let mut found = false;
    let mut next_is_object = false;
    for arg in qemu {
        if !std::mem::take(&mut next_is_object) {
            next_is_object = arg == "-object" || arg == "--object";
            out.push(arg.clone());
            continue;
        }
        let mut parts = split_suboptions(arg);
        let file_backend = parts
            .iter()
            .any(|p| p == "memory-backend-file" || p == "qom-type=memory-backend-file");
        let at = parts
            .iter()
            .position(|p| p.strip_prefix("mem-path=").is_some_and(is_ram));
        let (true, Some(at)) = (file_backend, at) else {
            out.push(arg.clone());
            continue;
        };
        if !parts
            .iter()
            .any(|p| matches!(p.as_str(), "share=on" | "share=yes" | "share=true"))
        {
            return Err(VmError(format!(
                "the QEMU command maps {}/{VM_RAM_IMAGE} without share=on: the guest's RAM                  would not be the file (add share=on to that -object)",
                dir.display()
            )));
        }
        if let Some(new) = mem_path {
            parts[at] = format!("mem-path={}", new.display());
        }
        out.push(join_suboptions(&parts));
        found = true;
    }
    if !found {
        return Err(VmError(format!(
            "this version keeps the guest's RAM as image {VM_RAM_IMAGE}: the QEMU command must              map it, e.g. -object memory-backend-file,id=mem,size=SIZE,mem-path={}/{VM_RAM_IMAGE},\
             share=on -machine memory-backend=mem",
            dir.display()
        )));
    }
    Ok(out)
}

/// QEMU's `a=b,c=d` suboptions, `,,` standing for a comma inside a value.
fn split_suboptions(s: &str) -> Vec<String> {
    let mut parts = vec![String::new()];
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                if let Some(p) = parts.last_mut() {
                    p.push(',');
                }
            } else {
                parts.push(String::new());
            }
        } else if let Some(p) = parts.last_mut() {
            p.push(c);
        }
    }
    parts
}

/// The inverse of [`split_suboptions`].
fn join_suboptions(parts: &[String]) -> String {
    parts
        .iter()
        .map(|p| p.replace(',', ",,"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Sends SIGTERM to QEMU (which then quits cleanly).
fn pass_on(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        if pid > 0 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory standing for PATH, holding `names` as executables (the
    /// empty scripts are never run by these tests) and `plain` as a file
    /// without execute permission.
    fn fake_path(names: &[&str], plain: &[&str]) -> tempfile::TempDir {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        for (name, mode) in names
            .iter()
            .map(|n| (n, 0o755))
            .chain(plain.iter().map(|n| (n, 0o644)))
        {
            let p = dir.path().join(name);
            std::fs::write(&p, "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        dir
    }

    fn argv(c: &std::process::Command) -> Vec<String> {
        std::iter::once(c.get_program())
            .chain(c.get_args())
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn qemu_is_started_through_setpriv_and_the_guard_naming_roams_pid() {
        let dir = fake_path(&["setpriv", "qemu-system-x86_64"], &[]);
        let (c, warning) = qemu_command(
            "qemu-system-x86_64",
            4242,
            true,
            Some(dir.path().as_os_str()),
        )
        .unwrap();
        assert_eq!(warning, None);
        assert_eq!(
            argv(&c),
            [
                "setpriv",
                "--pdeathsig",
                "KILL",
                "--",
                "/bin/sh",
                "-c",
                GUARD,
                "4242",
                "qemu-system-x86_64"
            ]
        );
    }

    #[test]
    fn off_the_main_thread_or_without_setpriv_qemu_starts_alone_with_a_warning() {
        let dir = fake_path(&["setpriv", "qemu"], &[]);
        let (c, warning) = qemu_command("qemu", 1, false, Some(dir.path().as_os_str())).unwrap();
        assert_eq!(argv(&c), ["qemu"]);
        assert!(warning.unwrap().contains("off roam's main thread"));
        let dir = fake_path(&["qemu"], &[]);
        let (c, warning) = qemu_command("qemu", 1, true, Some(dir.path().as_os_str())).unwrap();
        assert_eq!(argv(&c), ["qemu"]);
        assert!(warning.unwrap().contains("setpriv (util-linux) not found"));
    }

    #[test]
    fn a_missing_or_unexecutable_qemu_is_refused_by_name() {
        let dir = fake_path(&["setpriv"], &["qemu"]);
        let path = Some(dir.path().as_os_str());
        let e = qemu_command("qemu", 1, true, path).unwrap_err().0;
        assert!(e.contains("is not executable") && e.contains("qemu"), "{e}");
        let plain = dir.path().join("qemu");
        let e = qemu_command(plain.to_str().unwrap(), 1, true, path)
            .unwrap_err()
            .0;
        assert!(e.contains("it is not executable"), "{e}");
        let e = qemu_command("qemu-nowhere", 1, true, path).unwrap_err().0;
        assert!(e.contains("no such program"), "{e}");
        let e = qemu_command("/nowhere/qemu", 1, true, path).unwrap_err().0;
        assert!(e.contains("no such program"), "{e}");
    }

    /// Whether process `pid` runs `comm` within 10 s.
    fn becomes(pid: u32, comm: &str) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let now = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if now.trim() == comm {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }

    /// The real setpriv and shell: the guard executes the program in the
    /// same process when its parent is the pid it names (the pid roam
    /// reports is QEMU's), and executes nothing when the parent is another
    /// process, as after a roam killed before setpriv's `prctl`.
    #[test]
    fn the_guard_runs_the_program_only_under_the_pid_it_names() {
        let path = std::env::var_os("PATH");
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("ran");
        // Parent is this test process: the program runs, in the same pid.
        let (mut c, warning) =
            qemu_command("sleep", std::process::id(), true, path.as_deref()).unwrap();
        assert_eq!(warning, None, "setpriv (util-linux) is needed by this test");
        let mut child = c.arg("30").spawn().unwrap();
        let pid = child.id();
        assert!(becomes(pid, "sleep"), "pid {pid} never became the program");
        child.kill().unwrap();
        child.wait().unwrap();
        // Parent named wrongly (pid 1 is never this test's): nothing runs.
        let (mut c, _) = qemu_command("touch", 1, true, path.as_deref()).unwrap();
        let status = c.arg(&marker).status().unwrap();
        assert_eq!(status.code(), Some(1));
        assert!(
            !marker.exists(),
            "the guard ran the program under another parent"
        );
    }

    /// Why only the main thread forks QEMU with the death signal: the
    /// signal follows the forking thread, so a child forked by a thread
    /// that then ends is killed while its process lives on.
    #[test]
    fn a_child_forked_by_a_thread_that_ends_is_killed() {
        let path = std::env::var_os("PATH");
        let mut child = std::thread::spawn(move || {
            let (mut c, _) =
                qemu_command("sleep", std::process::id(), true, path.as_deref()).unwrap();
            let child = c.arg("30").spawn().unwrap();
            // Past setpriv's prctl before this thread ends.
            assert!(becomes(child.id(), "sleep"));
            child
        })
        .join()
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "the child outlived its forking thread by 10 s"
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        use std::os::unix::process::ExitStatusExt as _;
        assert_eq!(status.signal(), Some(9), "{status}");
    }

    #[test]
    fn quoting_survives_quotes_and_spaces() {
        assert_eq!(shell_quote("/a b/c"), "'/a b/c'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn drives_of_the_version_are_rewritten_to_nbd() {
        let args: Vec<String> = [
            "qemu-system-x86_64",
            "-drive",
            "file=/vm/disk.img,format=raw,if=virtio",
            "-drive",
            "if=virtio,file=/elsewhere/disk.img",
            "--drive",
            "file=/vm/data,,1.img,format=raw",
            "-append",
            "-drive file=/vm/disk.img",
        ]
        .map(String::from)
        .to_vec();
        let (out, served) = nbd_drives(&args, Path::new("/vm"), &["disk.img", "data,1.img"], |i| {
            PathBuf::from(format!("/vm/.nbd-{i}.sock"))
        });
        assert_eq!(served, ["disk.img", "data,1.img"]);
        assert_eq!(
            out[2],
            "file.driver=nbd,file.server.type=unix,file.server.path=/vm/.nbd-disk.img.sock,\
             file.export=disk.img,format=raw,if=virtio"
        );
        assert_eq!(
            out[4], "if=virtio,file=/elsewhere/disk.img",
            "another directory"
        );
        assert_eq!(
            out[6],
            "file.driver=nbd,file.server.type=unix,file.server.path=/vm/.nbd-data,,1.img.sock,\
             file.export=data,,1.img,format=raw"
        );
        assert_eq!(out[8], "-drive file=/vm/disk.img", "not an option");
        assert_eq!(out.len(), args.len());
    }

    #[test]
    fn the_ram_backend_is_found_checked_and_pointed_elsewhere() {
        let args: Vec<String> = [
            "qemu",
            "-object",
            "memory-backend-file,id=mem,size=128M,mem-path=/vm/vm-ram,share=on",
            "-machine",
            "memory-backend=mem",
        ]
        .map(String::from)
        .to_vec();
        let out = ram_backend(&args, Path::new("/vm"), Some(Path::new("/vm/.m/vm-ram"))).unwrap();
        assert_eq!(
            out[2],
            "memory-backend-file,id=mem,size=128M,mem-path=/vm/.m/vm-ram,share=on"
        );
        assert_eq!(ram_backend(&args, Path::new("/vm"), None).unwrap(), args);
        let e = ram_backend(&args, Path::new("/other"), None).unwrap_err();
        assert!(e.0.contains("mem-path=/other/vm-ram"), "{e}");
        let mut private = args.clone();
        private[2] = "memory-backend-file,id=mem,size=128M,mem-path=/vm/vm-ram".into();
        let e = ram_backend(&private, Path::new("/vm"), None).unwrap_err();
        assert!(e.0.contains("share=on"), "{e}");
    }

    #[test]
    fn memory_file_lies_beside_the_first_disk() {
        let f = memory_file_for(Some(Path::new("/vm/disk.img")));
        assert_eq!(f.parent(), Some(Path::new("/vm")));
        assert!(f
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(".vm-memory.roam-suspend."));
        assert_eq!(
            memory_file_for(Some(Path::new("disk.img"))).parent(),
            Some(Path::new("."))
        );
    }
}
