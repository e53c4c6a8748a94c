//! Internet Suspend/Resume of a real QEMU guest (TCG) with `roam suspend
//! --vm` and `roam resume --vm`: the guest built by `scripts/guest-build`
//! (`$ROAM_GUEST`) keeps a counter in memory and appends a numbered line to
//! a file on its ext2 disk every second, checking the whole file each time
//! and printing `roam-guest: tick N lines L ok` on its serial console.
//!
//! Site A runs the guest, suspends it into a local store (memory through
//! QEMU's migration stream, disk chunked and encrypted); site B (another
//! directory and, as root, another network namespace) resumes it: the
//! counter goes on from A's last tick (no reboot) and the guest finds its
//! file whole. B suspends it again (only changed chunks move) and A resumes
//! it. The store's bytes never hold the text the guest wrote.
//! Demand fetch (`--demand-fetch`) runs from a local store and through a
//! store server (`roam store serve`, `--store roam://`).
//!
//! Without `$ROAM_GUEST` the test says why and passes; with it set, a
//! missing QEMU or a broken guest fails it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The binary under test.
const BIN: &str = env!("CARGO_BIN_EXE_roam");

/// What the guest writes into its file, line after line.
const MARK: &[u8] = b"ROAMISR-MARK";

/// Longest the guest may take to boot and tick (TCG on a shared 2-core
/// machine boots it in about 6 s).
const BOOT_TIMEOUT: Duration = Duration::from_secs(90);

/// The guest's files, from `$ROAM_GUEST`; `None` (the test skips) without it.
fn guest() -> Option<PathBuf> {
    let Some(dir) = std::env::var_os("ROAM_GUEST").filter(|d| !d.is_empty()) else {
        eprintln!(
            "SKIP: $ROAM_GUEST is not set (ROAM_GUEST=$(scripts/guest-build) builds the guest; \
             it needs qemu-system-x86 busybox-static cpio)"
        );
        return None;
    };
    let dir = PathBuf::from(dir);
    for f in ["vmlinuz", "initrd.gz", "disk.img"] {
        assert!(
            dir.join(f).is_file(),
            "$ROAM_GUEST={} lacks {f}: run scripts/guest-build",
            dir.display()
        );
    }
    let qemu = Command::new("qemu-system-x86_64").arg("--version").output();
    assert!(
        qemu.as_ref().is_ok_and(|o| o.status.success()),
        "$ROAM_GUEST is set but qemu-system-x86_64 does not run: {qemu:?}"
    );
    Some(dir)
}

/// Kills a process (QEMU, or `roam resume` with its QEMU) and reaps it when
/// dropped; QEMU's pid file names the QEMU a `roam resume` started.
struct Proc {
    child: Child,
    pidfile: PathBuf,
}

impl Proc {
    /// Waits up to `limit` for the process to exit by itself.
    fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(pid) = std::fs::read_to_string(&self.pidfile)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            if std::path::Path::new(&format!("/proc/{pid}")).exists() {
                let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A site: a directory standing for a machine, with its copy of the disk.
struct Site {
    dir: PathBuf,
    /// The guest's RAM is the shared file DIR/vm-ram (lazy memory), not
    /// QEMU's anonymous memory.
    lazy: bool,
}

impl Site {
    fn qmp(&self) -> PathBuf {
        self.dir.join("qmp.sock")
    }

    fn disk(&self) -> PathBuf {
        self.dir.join("disk.img")
    }

    /// QEMU's command line for the guest at this site (the same machine at
    /// every site; only paths differ), its console going to `serial`.
    fn qemu(&self, guest: &Path, serial: &str) -> Vec<String> {
        let s = |p: PathBuf| p.display().to_string();
        let mut ram = Vec::new();
        if self.lazy {
            ram = vec![
                "-object".into(),
                format!(
                    "memory-backend-file,id=mem,size=128M,mem-path={},share=on",
                    self.dir.join("vm-ram").display()
                ),
                "-machine".into(),
                "memory-backend=mem".into(),
            ];
        }
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
            format!("file={},format=raw,if=virtio", self.disk().display()),
            "-serial".into(),
            format!("file:{}", self.dir.join(serial).display()),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", self.qmp().display()),
            "-pidfile".into(),
            s(self.dir.join("qemu.pid")),
        ];
        args.extend(ram);
        args
    }

    /// The ticks on a console log: (n, lines, ok) in order.
    fn ticks(&self, serial: &str) -> Vec<(u64, u64, bool)> {
        let text = std::fs::read(self.dir.join(serial)).unwrap_or_default();
        String::from_utf8_lossy(&text)
            .lines()
            .filter_map(|l| {
                let rest = l.split("roam-guest: tick ").nth(1)?;
                let f: Vec<&str> = rest.split_whitespace().collect();
                Some((
                    f.first()?.parse().ok()?,
                    f.get(2)?.parse().ok()?,
                    *f.get(3)? == "ok",
                ))
            })
            .collect()
    }

    /// Waits until the console shows tick `n` or later; returns the ticks.
    fn wait_tick(&self, serial: &str, n: u64, proc: &mut Proc) -> Vec<(u64, u64, bool)> {
        let deadline = Instant::now() + BOOT_TIMEOUT;
        loop {
            let ticks = self.ticks(serial);
            if ticks.last().is_some_and(|t| t.0 >= n) {
                return ticks;
            }
            if let Ok(Some(status)) = proc.child.try_wait() {
                panic!(
                    "the guest's process exited ({status}) before tick {n}; console:\n{}",
                    String::from_utf8_lossy(
                        &std::fs::read(self.dir.join(serial)).unwrap_or_default()
                    )
                );
            }
            assert!(
                Instant::now() < deadline,
                "no tick {n} within {BOOT_TIMEOUT:?}; console:\n{}",
                String::from_utf8_lossy(&std::fs::read(self.dir.join(serial)).unwrap_or_default())
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// `roam ARGS` with the state directory `state`.
fn roam(state: &Path) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env("ROAM_STATE_DIR", state)
        .env("XDG_CONFIG_HOME", state.join("no-config"));
    cmd
}

/// Runs a finished command, expecting success; returns its output.
fn ok(what: &str, out: Output) -> Output {
    assert!(
        out.status.success(),
        "{what}: {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The chunks uploaded for `image` in a suspend's progress lines
/// ("IMAGE: done, T chunks, ... uploaded (U chunks)"): (T, U).
fn image_chunks(stderr: &str, image: &str) -> (u64, u64) {
    let line = stderr
        .lines()
        .find(|l| l.contains(&format!("] {image}: done,")))
        .unwrap_or_else(|| panic!("no summary of {image} in:\n{stderr}"));
    let num_before = |label: &str| -> u64 {
        let at = line
            .find(label)
            .unwrap_or_else(|| panic!("{label} in {line}"));
        line[..at]
            .split_whitespace()
            .last()
            .unwrap()
            .trim_start_matches('(')
            .parse()
            .unwrap()
    };
    (num_before(" chunks,"), num_before(" chunks)"))
}

/// Whether `needle` occurs in any file under `dir`.
fn any_file_contains(dir: &Path, needle: &[u8]) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if let Some(p) = any_file_contains(&path, needle) {
                return Some(p);
            }
        } else if std::fs::read(&path)
            .unwrap()
            .windows(needle.len())
            .any(|w| w == needle)
        {
            return Some(path);
        }
    }
    None
}

/// Whether this process may make network namespaces (root).
fn can_unshare_net() -> bool {
    Command::new("unshare")
        .args(["--net", "true"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `roam resume --vm` of the newest version into `site`, in a network
/// namespace of its own when `netns`.
fn resume_at(
    state: &Path,
    store: &Path,
    site: &Site,
    guest: &Path,
    serial: &str,
    netns: bool,
) -> Proc {
    resume_with(state, store, site, (guest, serial), netns, &[], None)
}

/// [`resume_at`] with `extra` options (`--demand-fetch`), roam's stdout and
/// stderr going to `log` if given.
fn resume_with(
    state: &Path,
    store: &Path,
    site: &Site,
    (guest, serial): (&Path, &str),
    netns: bool,
    extra: &[&str],
    log: Option<&Path>,
) -> Proc {
    let mut args: Vec<String> = Vec::new();
    let program = if netns {
        args.extend(["--net".into(), "--".into(), BIN.into()]);
        "unshare".to_string()
    } else {
        BIN.to_string()
    };
    args.extend(
        [
            "resume",
            "--env",
            "lab",
            "--store",
            &store.display().to_string(),
            "--force",
            "--vm",
        ]
        .map(String::from),
    );
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend([site.dir.display().to_string(), "--".into()]);
    args.extend(site.qemu(guest, serial));
    let mut cmd = Command::new(program);
    cmd.args(&args)
        .env("ROAM_STATE_DIR", state)
        .env("XDG_CONFIG_HOME", state.join("no-config"));
    match log {
        Some(path) => {
            std::fs::create_dir_all(&site.dir).unwrap();
            let f = std::fs::File::create(path).unwrap();
            cmd.stdout(f.try_clone().unwrap()).stderr(f);
        }
        None => {
            cmd.stdout(Stdio::inherit()).stderr(Stdio::inherit());
        }
    }
    let _ = std::fs::remove_file(site.dir.join("qemu.pid"));
    Proc {
        child: cmd.spawn().unwrap(),
        pidfile: site.dir.join("qemu.pid"),
    }
}

/// `roam suspend --vm` of the guest at `site`; returns (stdout, stderr).
fn suspend_at(state: &Path, store: &Path, site: &Site, proc: &mut Proc) -> (String, String) {
    let start = Instant::now();
    let out = ok(
        "roam suspend --vm",
        roam(state)
            .args(["suspend", "--env", "lab", "--store"])
            .arg(store)
            .arg("--vm")
            .arg(site.qmp())
            .arg(site.disk())
            .output()
            .unwrap(),
    );
    let took = start.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!(
        "suspend at {} took {took:?}:\n{stdout}{stderr}",
        site.dir.display()
    );
    // The suspended VM quits (a `roam resume --vm` then exits with QEMU's status).
    let status = proc.wait_exit(Duration::from_secs(20));
    assert!(status.is_some(), "the VM did not quit after its suspend");
    (stdout, stderr)
}

/// The last tick before a suspend, checked whole.
fn last_tick(ticks: &[(u64, u64, bool)], what: &str) -> u64 {
    for (n, lines, okay) in ticks {
        assert!(*okay, "{what}: tick {n} found the file bad ({lines} lines)");
    }
    ticks.last().unwrap().0
}

#[test]
fn a_qemu_guest_suspended_at_a_resumes_at_b_and_back() {
    let Some(guest) = guest() else { return };
    let test_start = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let store = tmp.path().join("store");
    let site_a = Site {
        dir: tmp.path().join("site-a"),
        lazy: false,
    };
    let site_b = Site {
        dir: tmp.path().join("site-b"),
        lazy: false,
    };
    std::fs::create_dir_all(&site_a.dir).unwrap();
    std::fs::copy(guest.join("disk.img"), site_a.disk()).unwrap();
    let netns = can_unshare_net();
    if !netns {
        eprintln!("note: not root: site B runs in this network namespace");
    }

    // Site A: boot the guest and let it count to 3.
    let boot = Instant::now();
    let args = site_a.qemu(&guest, "serial-a1");
    let mut qemu_a = Proc {
        child: Command::new(&args[0]).args(&args[1..]).spawn().unwrap(),
        pidfile: site_a.dir.join("qemu.pid"),
    };
    site_a.wait_tick("serial-a1", 3, &mut qemu_a);
    eprintln!("guest boot to tick 3: {:?}", boot.elapsed());

    let (out1, err1) = suspend_at(&state, &store, &site_a, &mut qemu_a);
    assert!(out1.contains("suspended lab version 1"), "{out1}");
    let n_a = last_tick(&site_a.ticks("serial-a1"), "site A");
    let (disk_total, _) = image_chunks(&err1, "disk.img");
    assert_eq!(disk_total, 512, "a 64 MiB disk is 512 chunks");

    // The guest's text is on A's disk in the clear, never in the store.
    assert!(any_file_contains(&site_a.dir, MARK).is_some());
    assert_eq!(
        any_file_contains(&store, MARK),
        None,
        "the store holds the guest's plaintext"
    );

    // Site B: another directory (and network namespace); the counter goes
    // on from A's last tick, without a reboot, and the file is whole.
    let resume_b = Instant::now();
    let mut at_b = resume_at(&state, &store, &site_b, &guest, "serial-b", netns);
    let ticks_b = site_b.wait_tick("serial-b", n_a + 2, &mut at_b);
    eprintln!("resume at B to its first tick: {:?}", resume_b.elapsed());
    assert_eq!(
        ticks_b.first().map(|t| t.0),
        Some(n_a + 1),
        "the counter at B goes on from A's last tick {n_a}: {ticks_b:?}"
    );
    let serial_b = std::fs::read_to_string(site_b.dir.join("serial-b")).unwrap();
    assert!(
        !serial_b.contains("booted"),
        "the guest rebooted at B:\n{serial_b}"
    );
    if netns {
        let pid = std::fs::read_to_string(site_b.dir.join("qemu.pid")).unwrap();
        let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/net")).unwrap();
        assert_ne!(ns(pid.trim()), ns("self"), "QEMU at B in its own netns");
    }

    // B suspends again: the disk's changed chunks only (a few lines of
    // log), not the 64 MiB.
    let (out2, err2) = suspend_at(&state, &store, &site_b, &mut at_b);
    assert!(out2.contains("suspended lab version 2"), "{out2}");
    let n_b = last_tick(&site_b.ticks("serial-b"), "site B");
    let (disk_total2, disk_up2) = image_chunks(&err2, "disk.img");
    let (mem_total2, mem_up2) = image_chunks(&err2, "vm-memory");
    eprintln!(
        "second suspend: disk {disk_up2} of {disk_total2} chunks uploaded, memory {mem_up2} of \
         {mem_total2}"
    );
    assert!(
        disk_up2 <= 8,
        "only the disk's changed chunks move: {disk_up2} of {disk_total2}"
    );
    assert!(
        disk_up2 + mem_up2 < (disk_total2 + mem_total2) / 2,
        "most chunks stay: {} of {}",
        disk_up2 + mem_up2,
        disk_total2 + mem_total2
    );
    assert_eq!(any_file_contains(&store, MARK), None);

    // Back at A (its old files overwritten): on from B's last tick.
    let mut at_a = resume_at(&state, &store, &site_a, &guest, "serial-a2", false);
    let ticks_a2 = site_a.wait_tick("serial-a2", n_b + 2, &mut at_a);
    assert_eq!(ticks_a2.first().map(|t| t.0), Some(n_b + 1), "{ticks_a2:?}");
    last_tick(&ticks_a2, "site A again");
    drop(at_a);
    eprintln!("test wall time: {:?}", test_start.elapsed());
}

/// The numbers of the demand-fetch summary line of `image`: "IMAGE: P of
/// N chunks present at QEMU start, R when the guest ran; D chunks ..."
/// as (P, N, R, D).
fn demand_line(log: &str, image: &str) -> (u64, u64, u64, u64) {
    let line = log
        .lines()
        .find(|l| {
            l.trim_start().starts_with(&format!("{image}: ")) && l.contains("present at QEMU start")
        })
        .unwrap_or_else(|| panic!("no demand-fetch summary of {image} in:\n{log}"));
    let nums: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit() && c != '.')
        .filter(|w| !w.is_empty() && !w.contains('.'))
        .filter_map(|w| w.parse().ok())
        .collect();
    (nums[0], nums[1], nums[2], nums[3])
}

/// Resumes `lab` at `site_b` by demand fetch (roam resume's output in
/// `log`; `via` names the store in messages, e.g. " through ADDR"), checks
/// that the guest's counter goes on from A's last tick `n_a`, that QEMU ran
/// before the disk was in and that the background fill completes it, then
/// suspends the guest there as version 2; returns B's last tick.
fn demand_fetch_at_b(
    (state, store): (&Path, &Path),
    site_b: &Site,
    guest: &Path,
    n_a: u64,
    (log, via): (&Path, &str),
) -> u64 {
    let resume_b = Instant::now();
    let mut at_b = resume_with(
        state,
        store,
        site_b,
        (guest, "serial-b"),
        false,
        &["--demand-fetch"],
        Some(log),
    );
    let ticks_b = site_b.wait_tick("serial-b", n_a + 2, &mut at_b);
    eprintln!(
        "demand-fetch resume{via} at B to its first tick: {:?}",
        resume_b.elapsed()
    );
    assert_eq!(
        ticks_b.first().map(|t| t.0),
        Some(n_a + 1),
        "the counter at B goes on from A's last tick {n_a}: {ticks_b:?}"
    );
    last_tick(&ticks_b, &format!("site B (demand fetch{via})"));
    // The background fill completes the disk while the guest runs.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !site_b.disk().exists() {
        assert!(
            Instant::now() < deadline,
            "the background fill did not finish: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Suspend at B (through QEMU, whose disk is the NBD export): roam
    // resume prints its summary when QEMU exits.
    let (out2, _) = suspend_at(state, store, site_b, &mut at_b);
    assert!(out2.contains("suspended lab version 2"), "{out2}");
    let n_b = last_tick(&site_b.ticks("serial-b"), "site B");
    let status = at_b.wait_exit(Duration::from_secs(60));
    let text = std::fs::read_to_string(log).unwrap();
    eprintln!("roam resume --demand-fetch{via} at B:\n{text}");
    assert_eq!(status.map(|s| s.success()), Some(true), "{text}");
    let (at_start, total, at_run, demand_before_run) = demand_line(&text, "disk.img");
    assert_eq!(total, 512, "{text}");
    assert!(
        at_start < total && at_run < total,
        "QEMU started before the disk was in: {at_start}, {at_run} of {total} chunks"
    );
    eprintln!(
        "demand fetch{via}: {at_start} of {total} disk chunks present at QEMU start, {at_run} \
         when the guest ran ({demand_before_run} fetched on demand before it ran)"
    );
    assert!(text.contains("background fill done"), "{text}");
    n_b
}

/// Sites A and B under `dir`; the guest booted at A from its disk, counting
/// to 3, then suspended into `store` (as version 1). Returns the sites and
/// `roam suspend`'s output.
fn suspended_at_a(guest: &Path, dir: &Path, state: &Path, store: &Path) -> (Site, Site, String) {
    suspended_at_a_with(guest, dir, (state, store), false)
}

/// A guest suspended at site A into a local store, as most tests begin.
struct AtA {
    /// The state directory of roam's keys.
    state: PathBuf,
    /// The store.
    store: PathBuf,
    /// Site A, where it ran.
    site_a: Site,
    /// Site B, where it resumes.
    site_b: Site,
    /// The guest's last counter tick at A.
    n_a: u64,
}

/// [`suspended_at_a`] with the state and the store under `dir`.
fn suspended_locally(guest: &Path, dir: &Path) -> AtA {
    let state = dir.join("state");
    let store = dir.join("store");
    let (site_a, site_b, _) = suspended_at_a(guest, dir, &state, &store);
    let n_a = last_tick(&site_a.ticks("serial-a1"), "site A");
    AtA {
        state,
        store,
        site_a,
        site_b,
        n_a,
    }
}

/// [`suspended_at_a`], the guest's RAM a shared file at every site when
/// `lazy`.
fn suspended_at_a_with(
    guest: &Path,
    dir: &Path,
    (state, store): (&Path, &Path),
    lazy: bool,
) -> (Site, Site, String) {
    let site_a = Site {
        dir: dir.join("site-a"),
        lazy,
    };
    let site_b = Site {
        dir: dir.join("site-b"),
        lazy,
    };
    std::fs::create_dir_all(&site_a.dir).unwrap();
    std::fs::copy(guest.join("disk.img"), site_a.disk()).unwrap();
    let args = site_a.qemu(guest, "serial-a1");
    let mut qemu_a = Proc {
        child: Command::new(&args[0]).args(&args[1..]).spawn().unwrap(),
        pidfile: site_a.dir.join("qemu.pid"),
    };
    site_a.wait_tick("serial-a1", 3, &mut qemu_a);
    let (out, _) = suspend_at(state, store, &site_a, &mut qemu_a);
    (site_a, site_b, out)
}

#[test]
fn a_guest_resumed_by_demand_fetch_runs_before_its_disk_is_in() {
    let Some(guest) = guest() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let AtA {
        state,
        store,
        site_a,
        site_b,
        n_a,
    } = suspended_locally(&guest, tmp.path());

    // Site B by demand fetch: QEMU runs on the memory image and the disk
    // comes over NBD as the guest touches it.
    let n_b = demand_fetch_at_b(
        (&state, &store),
        &site_b,
        &guest,
        n_a,
        (&tmp.path().join("resume-b.log"), ""),
    );
    // Nothing of the server is left in DIR.
    for entry in std::fs::read_dir(&site_b.dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(
            !name.contains("roam-nbd") && !name.contains("roam-demand"),
            "{name} left in {}",
            site_b.dir.display()
        );
    }

    // B's disk file, as filled and written, went into version 2: back at
    // A by copy-in the counter goes on and the guest finds its file whole.
    let mut at_a = resume_at(&state, &store, &site_a, &guest, "serial-a2", false);
    let ticks_a2 = site_a.wait_tick("serial-a2", n_b + 2, &mut at_a);
    assert_eq!(ticks_a2.first().map(|t| t.0), Some(n_b + 1), "{ticks_a2:?}");
    last_tick(&ticks_a2, "site A after demand fetch at B");
}

/// Flips a byte in the store object of every chunk of `image` in version
/// `version` of `lab` (through roam-store, with the user's secret), except
/// chunks another image of the version shares; returns how many objects
/// changed.
fn tamper_image(state: &Path, store: &Path, version: u64, image: &str) -> usize {
    use roam_store::{ChunkBackend, LocalDir, Store, UserSecret};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let secret: [u8; 32] = std::fs::read(state.join("store.secret"))
            .unwrap()
            .try_into()
            .unwrap();
        let store = Store::new(
            LocalDir::open(store).unwrap(),
            UserSecret::from_bytes(secret),
        );
        let m = store.load_manifest("lab", version).await.unwrap();
        let memory: std::collections::HashSet<String> = m
            .images
            .iter()
            .filter(|i| i.name != image)
            .flat_map(|i| i.chunks.iter().map(|c| c.object_name()))
            .collect();
        let mut names: Vec<String> = m
            .image(image)
            .unwrap()
            .chunks
            .iter()
            .map(|c| c.object_name())
            .filter(|n| !memory.contains(n))
            .collect();
        names.sort();
        names.dedup();
        for name in &names {
            let mut object = store.backend().get(name, u64::MAX).await.unwrap();
            let at = object.len() / 2;
            object[at] ^= 0x40;
            store.backend().delete(name).await.unwrap();
            store.backend().put_if_absent(name, object).await.unwrap();
        }
        names.len()
    })
}

#[test]
fn a_tampered_disk_chunk_fetched_on_demand_is_an_io_error_not_data() {
    let Some(guest) = guest() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let store = tmp.path().join("store");
    let (_, site_b, _) = suspended_at_a(&guest, tmp.path(), &state, &store);
    let tampered = tamper_image(&state, &store, 1, "disk.img");
    assert!(tampered > 0, "no disk chunk of its own to tamper");

    let log = tmp.path().join("resume-b.log");
    let mut at_b = resume_with(
        &state,
        &store,
        &site_b,
        (&guest, "serial-b"),
        false,
        &["--demand-fetch"],
        Some(&log),
    );
    // The first tampered chunk roam fetches (for the guest or the fill) is
    // refused, and said so.
    let deadline = Instant::now() + Duration::from_secs(60);
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("is corrupt") {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "no refusal of a tampered chunk within 60 s:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        text.contains("image \"disk.img\" chunk ") && text.contains("authentication failed"),
        "{text}"
    );
    // QEMU reads the disk's first sector as it starts: the read of the
    // tampered chunk is an I/O error for it, not data.
    assert!(
        text.contains("NBD Read of") && text.contains("an I/O error for QEMU"),
        "{text}"
    );
    // Give QEMU a while to load the memory and run the guest (or give up).
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline
        && !std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("the guest runs")
        && at_b.child.try_wait().ok().flatten().is_none()
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    let ran = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("the guest runs");
    // QEMU quits: the fill cannot complete, and DIR/disk.img never appears.
    let pid = std::fs::read_to_string(site_b.dir.join("qemu.pid")).unwrap();
    let _ = Command::new("kill").arg(pid.trim()).status();
    let status = at_b.wait_exit(Duration::from_secs(60));
    let text = std::fs::read_to_string(&log).unwrap();
    eprintln!("roam resume --demand-fetch with tampered disk chunks:\n{text}");
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{text}");
    if ran {
        assert!(text.contains("the disk is incomplete"), "{text}");
    }
    eprintln!("the guest ran despite the refused chunk: {ran}");
    assert!(!site_b.disk().exists(), "an incomplete disk under its name");
}

#[test]
fn help_teaches_the_vm_commands() {
    let tmp = tempfile::tempdir().unwrap();
    for (cmd, example) in [
        (
            "suspend",
            "roam suspend --env lab --vm /vm/qmp.sock /vm/disk.img",
        ),
        (
            "resume",
            "roam resume --env lab --force --vm /vm -- qemu-system-x86_64",
        ),
    ] {
        let out = ok(
            "help",
            roam(tmp.path()).args([cmd, "--help"]).output().unwrap(),
        );
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(
            help.contains(example),
            "roam {cmd} --help lacks {example:?}:\n{help}"
        );
        assert!(
            help.contains("vm-memory"),
            "roam {cmd} --help names the memory image"
        );
        if cmd == "resume" {
            for needle in [
                "--demand-fetch",
                "over NBD",
                "It pays when",
                "--trickle RATE",
                "leases/ENV",
            ] {
                assert!(help.contains(needle), "resume --help lacks {needle:?}");
            }
        }
    }
}

#[test]
fn vm_mistakes_are_one_precise_line() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let store = tmp.path().join("store");
    let disk = tmp.path().join("disk.img");
    std::fs::write(&disk, vec![7u8; 300_000]).unwrap();
    let one_line = |out: Output, needle: &str| {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let errors: Vec<&str> = stderr
            .lines()
            .filter(|l| !l.starts_with("roam: [") && !l.contains("created the store secret"))
            .collect();
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert_eq!(errors.len(), 1, "one line: {stderr}");
        assert!(
            errors[0].contains(needle),
            "{:?} lacks {needle:?}",
            errors[0]
        );
    };
    // No QEMU behind the socket: nothing is stored.
    let out = roam(&state)
        .args(["suspend", "--env", "lab", "--store"])
        .arg(&store)
        .arg("--vm")
        .arg(tmp.path().join("no-qmp.sock"))
        .arg(&disk)
        .output()
        .unwrap();
    one_line(out, "cannot connect to QEMU's QMP socket");
    // A version suspended without --vm has no VM to resume.
    ok(
        "plain suspend",
        roam(&state)
            .args(["suspend", "--env", "lab", "--store"])
            .arg(&store)
            .arg(&disk)
            .output()
            .unwrap(),
    );
    let out = roam(&state)
        .args(["resume", "--env", "lab", "--store"])
        .arg(&store)
        .arg("--vm")
        .arg(tmp.path().join("b"))
        .args(["--", "qemu-system-x86_64"])
        .output()
        .unwrap();
    one_line(out, "holds no VM memory image (vm-memory)");
    assert!(
        !tmp.path().join("b").join("disk.img").exists(),
        "nothing written"
    );
}

/// `roam store serve` on a free loopback port, its objects in `holder`,
/// admitting the client key of the state directory `state`; the running
/// server (killed when dropped) and its `roam://` address.
fn store_server(dir: &Path, holder: &Path, state: &Path) -> (Proc, String) {
    let key = ok("roam keygen", roam(state).arg("keygen").output().unwrap());
    let authorized = dir.join("authorized");
    std::fs::write(&authorized, &key.stdout).unwrap();
    let port = roam_sim::ports::free_loopback_port().unwrap();
    let server_state = dir.join("server-state");
    let server = Proc {
        child: roam(&server_state)
            .args(["store", "serve", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .arg("--store")
            .arg(holder)
            .arg("--authorized-keys")
            .arg(&authorized)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
        pidfile: server_state.join("no-pidfile"),
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the store server never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    (server, format!("roam://127.0.0.1:{port}"))
}

/// Demand fetch through a store server (`--store roam://`): suspended at A
/// into the server, the guest resumes at B on its memory image while its
/// disk chunks come through the roam session as it touches them; the
/// counter goes on, the background fill completes, B suspends version 2
/// through the server and A resumes it whole. The server's directory holds
/// no text the guest wrote.
#[test]
fn a_guest_resumed_by_demand_fetch_through_a_store_server() {
    let Some(guest) = guest() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let holder = tmp.path().join("holder");
    let (_server, addr) = store_server(tmp.path(), &holder, &state);
    let store = PathBuf::from(&addr);
    let (site_a, site_b, out1) = suspended_at_a(&guest, tmp.path(), &state, &store);
    assert!(out1.contains(&format!("to {addr}")), "{out1}");
    let n_a = last_tick(&site_a.ticks("serial-a1"), "site A");

    let via = format!(" through {addr}");
    let n_b = demand_fetch_at_b(
        (&state, &store),
        &site_b,
        &guest,
        n_a,
        (&tmp.path().join("resume-b.log"), &via),
    );

    let mut at_a = resume_at(&state, &store, &site_a, &guest, "serial-a2", false);
    let ticks_a2 = site_a.wait_tick("serial-a2", n_b + 2, &mut at_a);
    assert_eq!(ticks_a2.first().map(|t| t.0), Some(n_b + 1), "{ticks_a2:?}");
    last_tick(
        &ticks_a2,
        "site A after demand fetch through the store server",
    );
    drop(at_a);
    assert_eq!(any_file_contains(&holder, MARK), None);
}

/// Sends one QMP command (`{"execute": CMD}`) to the QEMU whose QMP socket
/// is `sock`, after the capabilities handshake; panics on a QMP error.
fn qmp_command(sock: &Path, cmd: &str) {
    use std::io::{BufRead, BufReader, Write};
    let stream = std::os::unix::net::UnixStream::connect(sock).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.contains("QMP"), "not a QMP greeting: {line}");
    for execute in ["qmp_capabilities", cmd] {
        writeln!(writer, "{{\"execute\": \"{execute}\"}}").unwrap();
        loop {
            line.clear();
            assert!(reader.read_line(&mut line).unwrap() > 0, "QMP closed");
            if line.contains("\"event\"") {
                continue;
            }
            assert!(line.contains("\"return\""), "QMP {execute}: {line}");
            break;
        }
    }
}

/// The user's store at `store` (a local directory), opened with the
/// secret in the state directory `state`, and a runtime to drive it.
fn local_store(
    state: &Path,
    store: &Path,
) -> (
    tokio::runtime::Runtime,
    roam_store::Store<roam_store::LocalDir>,
) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let secret: [u8; 32] = std::fs::read(state.join("store.secret"))
        .unwrap()
        .try_into()
        .unwrap();
    let store = roam_store::Store::new(
        roam_store::LocalDir::open(store).unwrap(),
        roam_store::UserSecret::from_bytes(secret),
    );
    (rt, store)
}

/// The chunk ids of `disk` (a file) that version `version` of `lab` does
/// not have at the same index: the chunks written since.
fn changed_chunks(
    rt: &tokio::runtime::Runtime,
    store: &roam_store::Store<roam_store::LocalDir>,
    version: u64,
    disk: &Path,
) -> Vec<[u8; 32]> {
    let m = rt.block_on(store.load_manifest("lab", version)).unwrap();
    let entry = m.image("disk.img").unwrap();
    let bytes = std::fs::read(disk).unwrap();
    let mut ids: Vec<[u8; 32]> = bytes
        .chunks(roam_store::CHUNK_SIZE)
        .enumerate()
        .filter_map(|(i, c)| {
            let id = store.chunk_ref(c).id;
            (entry.chunks.get(i).map(|r| r.id) != Some(id)).then_some(id)
        })
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Trickle write-back (`--demand-fetch --trickle`): the guest resumed at B
/// appends to its disk; the chunks it changed reach the store while it
/// runs, named by the run's lease, and a `roam store gc` keeping only
/// version 1 leaves them; once the guest rests (stopped over QMP) every
/// changed chunk is in the store, so the suspend at B uploads no disk chunk
/// and says they were written back ahead. Resumed at A, the guest finds
/// every line it wrote at B. B's run releases its lease when QEMU exits.
#[test]
fn a_trickled_guest_leaves_its_suspend_no_disk_chunk_to_upload() {
    let Some(guest) = guest() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let AtA {
        state,
        store,
        site_a,
        site_b,
        n_a,
    } = suspended_locally(&guest, tmp.path());

    let log = tmp.path().join("resume-b.log");
    let mut at_b = resume_with(
        &state,
        &store,
        &site_b,
        (&guest, "serial-b"),
        false,
        &["--demand-fetch", "--trickle", "100M"],
        Some(&log),
    );
    // The guest writes a line a tick; the fill completes the disk file.
    site_b.wait_tick("serial-b", n_a + 4, &mut at_b);
    let deadline = Instant::now() + Duration::from_secs(120);
    while !site_b.disk().exists() {
        assert!(
            Instant::now() < deadline,
            "the background fill did not finish"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Chunks are written back while the guest runs: its progress says so.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("roam: trickle: ")
    {
        assert!(
            Instant::now() < deadline,
            "no trickle progress within 60 s:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The guest rests (stopped, as a user walking away): every chunk it
    // changed since version 1 reaches the store and the run's lease.
    qmp_command(&site_b.qmp(), "stop");
    let (rt, st) = local_store(&state, &store);
    let changed = changed_chunks(&rt, &st, 1, &site_b.disk());
    assert!(!changed.is_empty(), "the guest changed no disk chunk at B");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let leases = rt.block_on(st.leases(Some("lab"))).unwrap();
        let leased: std::collections::HashSet<[u8; 32]> =
            leases.iter().flat_map(|l| l.chunks.clone()).collect();
        let stored = changed.iter().all(|id| {
            let name = format!("chunks/{}", hex(id));
            leased.contains(id)
                && rt
                    .block_on(roam_store::ChunkBackend::exists(st.backend(), &name))
                    .unwrap()
        });
        if stored {
            assert_eq!(leases.len(), 1, "one lease for the one run: {leases:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the {} changed chunks did not all reach the store within 60 s:\n{}",
            changed.len(),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "{} disk chunks changed at B, all written back before the suspend",
        changed.len()
    );

    // gc during the live trickle (keeping version 1 only) keeps them.
    let gc = ok(
        "roam store gc",
        roam(&state)
            .args(["store", "gc", "--env", "lab", "--keep", "1", "--store"])
            .arg(&store)
            .output()
            .unwrap(),
    );
    let gc_out = String::from_utf8_lossy(&gc.stdout);
    eprintln!("gc during the trickle: {gc_out}");
    assert!(gc_out.contains("and 1 running environments ("), "{gc_out}");
    for id in &changed {
        let name = format!("chunks/{}", hex(id));
        assert!(
            rt.block_on(roam_store::ChunkBackend::exists(st.backend(), &name))
                .unwrap(),
            "gc deleted the trickled chunk {name}"
        );
    }

    // The suspend finds every changed disk chunk stored: none to upload.
    let (out2, err2) = suspend_at(&state, &store, &site_b, &mut at_b);
    assert!(out2.contains("suspended lab version 2"), "{out2}");
    let n_b = last_tick(&site_b.ticks("serial-b"), "site B");
    let (disk_total, disk_up) = image_chunks(&err2, "disk.img");
    assert_eq!(disk_total, 512);
    assert_eq!(
        disk_up, 0,
        "every changed disk chunk was written back ahead:\n{out2}"
    );
    let ahead = format!("trickle: {} of the ", changed.len());
    assert!(out2.contains(&ahead), "{ahead:?} in:\n{out2}");
    let status = at_b.wait_exit(Duration::from_secs(60));
    let text = std::fs::read_to_string(&log).unwrap();
    eprintln!("roam resume --trickle at B:\n{text}");
    assert_eq!(status.map(|s| s.success()), Some(true), "{text}");
    assert!(
        text.contains("when QEMU exited; its lease released (1 lease object deleted)"),
        "{text}"
    );
    assert!(rt.block_on(st.leases(Some("lab"))).unwrap().is_empty());

    // Back at A: on from B's last tick, and the file holds every line.
    let mut at_a = resume_at(&state, &store, &site_a, &guest, "serial-a2", false);
    let ticks_a2 = site_a.wait_tick("serial-a2", n_b + 2, &mut at_a);
    assert_eq!(ticks_a2.first().map(|t| t.0), Some(n_b + 1), "{ticks_a2:?}");
    last_tick(&ticks_a2, "site A after a trickled run at B");
    drop(at_a);
    assert_eq!(any_file_contains(&store, MARK), None);
}

/// `id` as 64 lowercase hex digits.
fn hex(id: &[u8; 32]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// A bad `--trickle` is refused before anything is read or started: a
/// rate that is not one, a rate below 8kbit, and `--trickle` without
/// `--demand-fetch` (it writes back what roam's NBD export sees).
#[test]
fn a_bad_trickle_rate_is_refused_with_what_to_write() {
    let tmp = tempfile::tempdir().unwrap();
    for (args, needle) in [
        (
            vec!["--demand-fetch", "--trickle", "fast"],
            "--trickle \"fast\": expected `off` or a rate in bits per second",
        ),
        (vec!["--demand-fetch", "--trickle", "1k"], "at least 8kbit"),
        (vec!["--trickle", "4M"], "--demand-fetch"),
    ] {
        let out = roam(tmp.path())
            .args(["resume", "--env", "lab", "--vm"])
            .args(&args)
            .arg(tmp.path().join("b"))
            .args(["--", "qemu-system-x86_64"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!tmp.path().join("b").exists(), "nothing made");
    }
}

/// Lazily unmounts whatever is still mounted under its directory when
/// dropped (a test that failed half-way, its roam killed).
struct UnmountUnder(PathBuf);

impl Drop for UnmountUnder {
    fn drop(&mut self) {
        for line in mounts_under(&self.0) {
            if let Some(point) = line.split_whitespace().nth(1) {
                let _ = Command::new("umount").args(["-l", point]).status();
            }
        }
    }
}

/// The FUSE mounts under `dir` in /proc/mounts.
fn mounts_under(dir: &Path) -> Vec<String> {
    std::fs::read_to_string("/proc/mounts")
        .unwrap()
        .lines()
        .filter(|l| l.contains(&dir.display().to_string()))
        .map(String::from)
        .collect()
}

/// Lazy guest memory: the guest's RAM is a shared file (`-object
/// memory-backend-file,share=on,mem-path=DIR/vm-ram`). A suspend at A
/// stores it as the flat image vm-ram and the device state (vm-devstate,
/// `x-ignore-shared`) apart; B resumes by demand fetch with the RAM a FUSE
/// file, the counter going on and the disk whole; B's suspend moves only
/// the chunks that changed; the mount is gone after; A resumes by copy-in.
/// A demand-fetch resume ended by SIGTERM to roam leaves no mount. Then a
/// tampered RAM chunk, fetched on demand at a site C, is refused with a
/// clear error, and again no mount is left.
#[test]
fn lazy_guest_memory_round_trip_by_demand_fetch_over_fuse() {
    let Some(guest) = guest() else { return };
    if !Path::new("/dev/fuse").exists() || !can_unshare_net() {
        eprintln!("SKIP: lazy memory needs /dev/fuse and the right to mount (root)");
        return;
    }
    let test_start = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let store = tmp.path().join("store");
    // Dropped after the processes: a failed run leaves no mount either.
    let _unmount = UnmountUnder(tmp.path().to_owned());
    let (site_a, site_b, out1) = suspended_at_a_with(&guest, tmp.path(), (&state, &store), true);
    assert!(out1.contains("vm-ram 134.2 MB"), "{out1}");
    assert!(out1.contains("vm-devstate"), "{out1}");
    assert!(!out1.contains("vm-memory"), "{out1}");
    let n_a = last_tick(&site_a.ticks("serial-a1"), "site A");

    // B: demand fetch, the RAM a FUSE file.
    let log = tmp.path().join("resume-b.log");
    let resume_b = Instant::now();
    let mut at_b = resume_with(
        &state,
        &store,
        &site_b,
        (&guest, "serial-b"),
        false,
        &["--demand-fetch"],
        Some(&log),
    );
    let ticks_b = site_b.wait_tick("serial-b", n_a + 2, &mut at_b);
    eprintln!(
        "lazy-memory demand-fetch resume at B to its first tick: {:?}",
        resume_b.elapsed()
    );
    assert_eq!(
        ticks_b.first().map(|t| t.0),
        Some(n_a + 1),
        "the counter at B goes on from A's last tick {n_a}: {ticks_b:?}"
    );
    assert!(
        mounts_under(&site_b.dir)
            .iter()
            .any(|l| l.contains("roam-memory")),
        "the RAM is not a FUSE file: {:?}",
        mounts_under(&site_b.dir)
    );
    // A suspend needs the disk's fill done (DIR/disk.img); the RAM is read
    // through the FUSE file, filled or not.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !site_b.disk().exists() {
        assert!(
            Instant::now() < deadline,
            "the disk's background fill did not finish: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (out2, err2) = suspend_at(&state, &store, &site_b, &mut at_b);
    assert!(out2.contains("suspended lab version 2"), "{out2}");
    let n_b = last_tick(&site_b.ticks("serial-b"), "site B");
    let (ram_total, ram_up) = image_chunks(&err2, "vm-ram");
    let (disk_total, disk_up) = image_chunks(&err2, "disk.img");
    eprintln!("second suspend: RAM {ram_up} of {ram_total} chunks, disk {disk_up} of {disk_total}");
    assert_eq!(ram_total, 1024, "128 MiB of RAM is 1024 chunks");
    assert!(
        ram_up < ram_total / 2,
        "only changed RAM chunks move: {ram_up}"
    );
    assert!(disk_up <= 8, "only changed disk chunks move: {disk_up}");
    let status = at_b.wait_exit(Duration::from_secs(120));
    let text = std::fs::read_to_string(&log).unwrap();
    eprintln!("roam resume --demand-fetch (lazy memory) at B:\n{text}");
    assert_eq!(status.map(|s| s.success()), Some(true), "{text}");
    let (_, total, at_run, before_run) = demand_line(&text, "vm-ram");
    assert_eq!(total, 1024, "{text}");
    assert!(
        at_run < total,
        "the guest ran before its RAM was in: {at_run}"
    );
    eprintln!("lazy memory: {before_run} RAM chunks fetched before the guest ran");
    assert_eq!(
        mounts_under(&site_b.dir),
        Vec::<String>::new(),
        "a mount left"
    );
    assert!(
        site_b.dir.join("vm-ram").is_file(),
        "the RAM image filled: {text}"
    );
    for entry in std::fs::read_dir(&site_b.dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(
            !name.contains("roam-ram") && !name.contains("roam-demand"),
            "{name} left in {}",
            site_b.dir.display()
        );
    }
    assert_eq!(any_file_contains(&store, MARK), None);

    // Back at A by copy-in of the RAM image.
    let mut at_a = resume_at(&state, &store, &site_a, &guest, "serial-a2", false);
    let ticks_a2 = site_a.wait_tick("serial-a2", n_b + 2, &mut at_a);
    assert_eq!(ticks_a2.first().map(|t| t.0), Some(n_b + 1), "{ticks_a2:?}");
    last_tick(&ticks_a2, "site A again (lazy memory)");
    drop(at_a);

    // SIGTERM to roam while the guest runs on its FUSE RAM: QEMU is told
    // to quit, roam ends, and the mount with it.
    let site_t = Site {
        dir: tmp.path().join("site-t"),
        lazy: true,
    };
    let log = tmp.path().join("resume-t.log");
    let mut at_t = resume_with(
        &state,
        &store,
        &site_t,
        (&guest, "serial-t"),
        false,
        &["--demand-fetch"],
        Some(&log),
    );
    site_t.wait_tick("serial-t", n_b + 1, &mut at_t);
    assert_eq!(mounts_under(&site_t.dir).len(), 1, "the RAM's mount");
    let _ = Command::new("kill")
        .args(["-TERM", &at_t.child.id().to_string()])
        .status();
    let status = at_t.wait_exit(Duration::from_secs(60));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(status.is_some(), "roam did not end on SIGTERM: {text}");
    assert_eq!(
        mounts_under(&site_t.dir),
        Vec::<String>::new(),
        "a mount left after SIGTERM: {text}"
    );

    // A tampered RAM chunk is refused, said so, and no mount is left.
    let tampered = tamper_image(&state, &store, 2, "vm-ram");
    assert!(tampered > 0, "no RAM chunk of its own to tamper");
    let site_c = Site {
        dir: tmp.path().join("site-c"),
        lazy: true,
    };
    let log = tmp.path().join("resume-c.log");
    let mut at_c = resume_with(
        &state,
        &store,
        &site_c,
        (&guest, "serial-c"),
        false,
        &["--demand-fetch"],
        Some(&log),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("is corrupt") {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "no refusal of a tampered RAM chunk within 60 s:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        text.contains("image \"vm-ram\" chunk ") && text.contains("authentication failed"),
        "{text}"
    );
    // QEMU cannot read that page (SIGBUS) and ends, or is ended here.
    let mut status = at_c.wait_exit(Duration::from_secs(20));
    if status.is_none() {
        if let Ok(pid) = std::fs::read_to_string(site_c.dir.join("qemu.pid")) {
            let _ = Command::new("kill").arg(pid.trim()).status();
        }
        status = at_c.wait_exit(Duration::from_secs(60));
    }
    let text = std::fs::read_to_string(&log).unwrap();
    eprintln!("roam resume --demand-fetch with tampered RAM chunks:\n{text}");
    assert!(status.is_some_and(|s| !s.success()), "{text}");
    assert_eq!(
        mounts_under(&site_c.dir),
        Vec::<String>::new(),
        "a mount left"
    );
    assert!(
        !site_c.dir.join("vm-ram").exists(),
        "an incomplete RAM image"
    );
    eprintln!("test wall time: {:?}", test_start.elapsed());
}

/// A `roam resume` killed outright (SIGKILL: no clean-up runs) takes its
/// QEMU with it: after a copy-in resume QEMU needs nothing of roam's and ran
/// on as an orphan before (`setpriv --pdeathsig`, `vm::dies_with_roam`).
#[test]
fn a_sigkilled_resume_takes_its_qemu_with_it() {
    let Some(guest) = guest() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let AtA {
        state,
        store,
        site_b,
        n_a,
        ..
    } = suspended_locally(&guest, tmp.path());
    let log = tmp.path().join("resume-q.log");
    let mut resumed = resume_with(
        &state,
        &store,
        &site_b,
        (&guest, "serial-q"),
        false,
        &[],
        Some(&log),
    );
    site_b.wait_tick("serial-q", n_a + 1, &mut resumed);
    let qemu = qemu_pid(&resumed);
    // The pid roam reports is QEMU's own: setpriv and the guard shell
    // executed it in the process roam forked.
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    let started_qemu = said
        .lines()
        .any(|l| l.contains("started ") && l.contains(&format!("(pid {qemu})")));
    resumed.child.kill().unwrap();
    resumed.child.wait().unwrap();
    let gone_within = wait_gone(qemu, Duration::from_secs(5));
    // Whatever the verdict, no QEMU is left (killed by its pid file).
    drop(resumed);
    assert!(
        gone_within.is_some(),
        "QEMU (pid {qemu}) outlived the killed roam resume by 5 s: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert!(
        started_qemu,
        "roam's \"started\" line does not name QEMU's pid {qemu}:\n{said}"
    );
}

/// ISR's hoarding with a real VM: `roam hoard` at site B fetches the
/// suspended version ahead of the user; `roam resume --vm --lookaside
/// HOARD` then takes every chunk of the memory image and of the disk from
/// the hoard (each checked against the manifest), fetches none from the
/// store, and the guest's counter goes on from A's, its file whole.
#[test]
fn a_vm_resumed_from_its_hoard_fetches_no_chunk() {
    let Some(guest) = guest() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let AtA {
        state,
        store,
        site_b,
        n_a,
        ..
    } = suspended_locally(&guest, tmp.path());
    let hoard = tmp.path().join("hoard-b");
    let hoarded = ok(
        "roam hoard",
        roam(&state)
            .args(["hoard", "--env", "lab", "--store"])
            .arg(&store)
            .arg(&hoard)
            .output()
            .unwrap(),
    );
    eprintln!("{}", String::from_utf8_lossy(&hoarded.stdout));
    let log = tmp.path().join("resume-h.log");
    let mut resumed = resume_with(
        &state,
        &store,
        &site_b,
        (&guest, "serial-h"),
        false,
        &["--lookaside", hoard.to_str().unwrap()],
        Some(&log),
    );
    let ticks = site_b.wait_tick("serial-h", n_a + 2, &mut resumed);
    assert_eq!(ticks.first().map(|t| t.0), Some(n_a + 1), "{ticks:?}");
    last_tick(&ticks, "site B, resumed from its hoard");
    let said = std::fs::read_to_string(&log).unwrap();
    drop(resumed);
    // "lookaside: T of T chunks (...) taken locally, ...: L bytes local,
    // 0 chunks and 0 bytes fetched, ..."
    let line = said
        .lines()
        .find(|l| l.trim_start().starts_with("lookaside:"))
        .unwrap_or_else(|| panic!("no lookaside line:\n{said}"));
    let numbers: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    let (taken, of) = (numbers[0], numbers[1]);
    assert!(
        of > 0 && taken == of,
        "not every chunk from the hoard: {line}"
    );
    assert!(
        line.contains(" 0 chunks and 0 bytes fetched"),
        "chunks fetched from the store despite the hoard: {line}"
    );
}

/// The pid of `p`'s QEMU, from its pid file.
fn qemu_pid(p: &Proc) -> u32 {
    std::fs::read_to_string(&p.pidfile)
        .ok()
        .and_then(|t| t.trim().parse::<u32>().ok())
        .expect("QEMU's pid file")
}

/// Waits until process `pid` is gone (or a zombie), at most `limit`; how
/// long that took.
fn wait_gone(pid: u32, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    let alive = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| {
            st.rsplit(')')
                .next()
                .is_some_and(|r| !r.trim_start().starts_with('Z'))
        })
    };
    while alive() {
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(start.elapsed())
}

/// A SIGKILLed `roam resume --demand-fetch` of lazy memory leaves its FUSE
/// mount (dead), its mount point and its sockets (its QEMU is gone within
/// 5 s); the next resume into the same DIR sweeps them (a line
/// naming the dead pid), runs the guest on from A's last tick, and once
/// ended by SIGTERM leaves no mount and no `.roam-ram.*`.
#[test]
fn a_sigkilled_lazy_resume_is_swept_by_the_next_resume() {
    let Some(guest) = guest() else { return };
    if !Path::new("/dev/fuse").exists() || !can_unshare_net() {
        eprintln!("SKIP: lazy memory needs /dev/fuse and the right to mount (root)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let store = tmp.path().join("store");
    let _unmount = UnmountUnder(tmp.path().to_owned());
    let (site_a, site_b, _) = suspended_at_a_with(&guest, tmp.path(), (&state, &store), true);
    let n_a = last_tick(&site_a.ticks("serial-a1"), "site A");
    let entries = |dir: &Path| -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    };

    let log = tmp.path().join("resume-k.log");
    let mut killed = resume_with(
        &state,
        &store,
        &site_b,
        (&guest, "serial-k"),
        false,
        &["--demand-fetch"],
        Some(&log),
    );
    site_b.wait_tick("serial-k", n_a + 1, &mut killed);
    let dead = killed.child.id();
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    let left = entries(&site_b.dir);
    assert!(
        left.contains(&format!(".roam-ram.{dead}")),
        "no leftover mount point: {left:?}"
    );
    assert_eq!(
        mounts_under(&site_b.dir).len(),
        1,
        "the dead resume's mount"
    );
    // Its QEMU is gone with it (its guest memory's server died; setpriv).
    let qemu = qemu_pid(&killed);
    let gone_within = wait_gone(qemu, Duration::from_secs(5));
    drop(killed);
    assert!(
        gone_within.is_some(),
        "QEMU (pid {qemu}) outlived the killed roam resume by 5 s"
    );

    let log = tmp.path().join("resume-k2.log");
    let mut again = resume_with(
        &state,
        &store,
        &site_b,
        (&guest, "serial-k2"),
        false,
        &["--demand-fetch"],
        Some(&log),
    );
    let ticks = site_b.wait_tick("serial-k2", n_a + 2, &mut again);
    assert_eq!(ticks.first().map(|t| t.0), Some(n_a + 1), "{ticks:?}");
    let mounts = mounts_under(&site_b.dir);
    assert_eq!(mounts.len(), 1, "only the new resume's mount: {mounts:?}");
    assert!(
        mounts[0].contains(&format!(".roam-ram.{}", again.child.id())),
        "{mounts:?}"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains(&format!("resume process {dead} (no longer running)"))
            && text.contains(&format!(".roam-ram.{dead} unmounted")),
        "no sweep line for the dead resume's mount: {text}"
    );
    let _ = Command::new("kill")
        .args(["-TERM", &again.child.id().to_string()])
        .status();
    let status = again.wait_exit(Duration::from_secs(60));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(status.is_some(), "roam did not end on SIGTERM: {text}");
    assert_eq!(
        mounts_under(&site_b.dir),
        Vec::<String>::new(),
        "a mount left: {text}"
    );
    let left = entries(&site_b.dir);
    assert!(
        !left
            .iter()
            .any(|n| n.starts_with(".roam-ram.") || n.starts_with(".roam-nbd-")),
        "left in {}: {left:?}\n{text}",
        site_b.dir.display()
    );
}
