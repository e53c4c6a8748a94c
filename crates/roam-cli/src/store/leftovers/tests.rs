//! The sweep against real leftovers: a process of this test binary mounts
//! the guest RAM's FUSE file as `roam resume --demand-fetch` does and is
//! SIGKILLed (its mount stays, its connection dead), beside sockets and
//! temporaries named after it, after a reused pid (`sleep`) and after a
//! live process of this binary (a concurrent resume, whose live mount must
//! survive). Without the right to mount FUSE (root, /dev/fuse) the mount
//! part says why and the rest runs.

use std::os::unix::net::UnixListener;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::demand::{DemandImage, Fetch};

/// Set for the helper process: the DIR it mounts in.
const HELPER_ENV: &str = "ROAM_TEST_LEFTOVERS_MOUNT_IN";

/// The helper's test name, for libtest's `--exact`.
const HELPER: &str = "store::leftovers::tests::helper_mounts_like_a_resume_then_waits";

/// Not a test by itself (without `$ROAM_TEST_LEFTOVERS_MOUNT_IN` it does
/// nothing): in a process of its own, it mounts a 4-chunk memory image on
/// DIR/.roam-ram.PID with its cache file DIR/.vm-ram.roam-demand.PID, as
/// `roam resume` does, writes DIR/ready.PID (`mounted`, or why not) and
/// waits to be killed.
#[test]
fn helper_mounts_like_a_resume_then_waits() {
    let Some(dir) = std::env::var_os(HELPER_ENV).map(PathBuf::from) else {
        return;
    };
    let pid = std::process::id();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let fetch: Fetch = Arc::new(|_| Box::pin(async { Ok((vec![7u8; 128 * 1024], false)) }));
    let image = DemandImage::create(
        "vm-ram",
        4 * 128 * 1024,
        128 * 1024,
        (
            &dir.join(format!(".vm-ram.roam-demand.{pid}")),
            &dir.join("vm-ram"),
        ),
        fetch,
        Arc::new(|_: &str| {}),
    )
    .unwrap();
    let point = dir.join(format!(".roam-ram.{pid}"));
    std::fs::create_dir(&point).unwrap();
    let mount = crate::demand::fuse::mount(Arc::new(image), &point, rt.handle().clone());
    let state = match &mount {
        Ok(_) => "mounted".to_owned(),
        Err(e) => e.clone(),
    };
    // Renamed into place: the test reads it whole.
    std::fs::write(dir.join(format!("ready-tmp.{pid}")), state).unwrap();
    std::fs::rename(
        dir.join(format!("ready-tmp.{pid}")),
        dir.join(format!("ready.{pid}")),
    )
    .unwrap();
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

/// A helper process; killed and reaped when dropped.
struct Helper {
    child: Child,
    /// Whether its FUSE mount is up.
    mounted: bool,
}

impl Helper {
    fn start(dir: &Path) -> Helper {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", HELPER, "--nocapture", "--test-threads=1"])
            .env(HELPER_ENV, dir)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let ready = dir.join(format!("ready.{}", child.id()));
        let deadline = Instant::now() + Duration::from_secs(30);
        let state = loop {
            if let Ok(s) = std::fs::read_to_string(&ready) {
                break s;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("the helper exited ({status}) before it was ready");
            }
            assert!(
                Instant::now() < deadline,
                "the helper was not ready in 30 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        std::fs::remove_file(&ready).unwrap();
        let mounted = state == "mounted";
        if !mounted {
            eprintln!("SKIP (the FUSE part): {state}");
        }
        Helper { child, mounted }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILLs it, as a killed `roam resume`, and reaps it.
    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `path` is a mount point here.
fn mounted(path: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    !mounts_at(&info, path).is_empty()
}

/// Lazily detaches whatever is still mounted under `dir` (a failed test
/// must not leave mounts behind).
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let Ok(entries) = std::fs::read_dir(&self.0) else {
            return;
        };
        for e in entries.flatten() {
            let _ = nix::mount::umount2(&e.path(), nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

#[test]
fn a_killed_resumes_leftovers_are_swept_a_live_ones_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = std::fs::canonicalize(tmp.path()).unwrap();
    let _unmount = Unmount(dir.clone());
    let mut dead = Helper::start(&dir);
    let live = Helper::start(&dir);
    dead.kill();
    let (d, l) = (dead.pid(), live.pid());
    // What else a resume makes, for the dead one and the live one.
    for pid in [d, l] {
        drop(UnixListener::bind(dir.join(format!(".roam-nbd-disk.img.{pid}.sock"))).unwrap());
        drop(UnixListener::bind(dir.join(format!(".roam-resume-qmp.{pid}"))).unwrap());
        std::fs::write(dir.join(format!(".disk.img.roam-resume.{pid}")), b"part").unwrap();
    }
    // A pid reused by a process that is not roam.
    let mut sleeper = Command::new("sleep").arg("60").spawn().unwrap();
    let s = sleeper.id();
    std::fs::create_dir(dir.join(format!(".roam-ram.{s}"))).unwrap();
    std::fs::write(dir.join(format!(".vm-ram.roam-demand.{s}")), b"").unwrap();
    // Not leftovers: a resumed image, other names, a leftover's name on
    // an entry of another type.
    let kept = [
        "disk.img".to_owned(),
        ".roam-ram.x1".to_owned(),
        format!(".roam-ram.{d}x"),
        format!(".roam-nbd-.{d}.sock"),
        format!("..roam-resume.{d}"),
    ];
    for k in &kept {
        std::fs::write(dir.join(k), b"mine").unwrap();
    }
    std::fs::create_dir(dir.join(format!(".disk2.img.roam-resume.{d}"))).unwrap();
    if dead.mounted {
        let point = dir.join(format!(".roam-ram.{d}"));
        assert!(mounted(&point), "the killed helper's mount went by itself");
        // What a SIGKILLed resume leaves: a mount whose server is gone.
        let err = std::fs::read_dir(&point).map(|_| ()).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(nix::libc::ENOTCONN), "{err}");
    }

    let mut lines = Vec::new();
    sweep(&dir, &mut |l: &str| lines.push(l.to_owned()));
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    let text = lines.join("\n");
    eprintln!("{text}");

    // Listed, not stat'ed: a stat of a dead FUSE mount point fails.
    let listed = |name: &str| {
        std::fs::read_dir(&dir)
            .unwrap()
            .any(|e| e.unwrap().file_name() == name)
    };
    let gone = |name: String| {
        let path = dir.join(&name);
        assert!(
            !listed(&name),
            "{name} was not swept; the sweep said:\n{text}"
        );
        assert!(!mounted(&path), "{name} is still mounted");
    };
    gone(format!(".roam-ram.{d}"));
    gone(format!(".vm-ram.roam-demand.{d}"));
    gone(format!(".roam-nbd-disk.img.{d}.sock"));
    gone(format!(".roam-resume-qmp.{d}"));
    gone(format!(".disk.img.roam-resume.{d}"));
    gone(format!(".roam-ram.{s}"));
    gone(format!(".vm-ram.roam-demand.{s}"));
    let there = |name: String| {
        assert!(listed(&name), "{name} was removed; the sweep said:\n{text}");
    };
    for name in [
        format!(".roam-ram.{l}"),
        format!(".vm-ram.roam-demand.{l}"),
        format!(".roam-nbd-disk.img.{l}.sock"),
        format!(".roam-resume-qmp.{l}"),
        format!(".disk.img.roam-resume.{l}"),
        format!(".disk2.img.roam-resume.{d}"),
    ] {
        there(name);
    }
    for k in kept {
        there(k);
    }
    if live.mounted {
        let point = dir.join(format!(".roam-ram.{l}"));
        assert!(mounted(&point), "the live helper's mount was detached");
        let page = std::fs::read(point.join("vm-ram")).unwrap();
        assert_eq!(page.len(), 4 * 128 * 1024);
        assert!(page.iter().all(|&b| b == 7), "the live mount reads wrong");
    }
    // One line per leftover swept, naming its pid; no warning.
    assert!(!text.contains("warning"), "{text}");
    assert_eq!(lines.len(), 7, "{text}");
    for (pid, n) in [(d, 5), (s, 2)] {
        let tag = format!("process {pid} ");
        assert_eq!(
            lines.iter().filter(|l| l.contains(&tag)).count(),
            n,
            "{text}"
        );
    }
    if dead.mounted {
        assert!(
            text.contains(&format!(
                "{} unmounted",
                dir.join(format!(".roam-ram.{d}")).display()
            )),
            "{text}"
        );
    }

    // Killed in turn, the live one's leftovers go at the next sweep.
    let mut live = live;
    live.kill();
    let mut again = Vec::new();
    sweep(&dir, &mut |l: &str| again.push(l.to_owned()));
    assert_eq!(again.len(), 5, "{}", again.join("\n"));
    gone(format!(".roam-ram.{l}"));
    gone(format!(".roam-nbd-disk.img.{l}.sock"));
}

#[test]
fn names_of_leftovers_parse() {
    assert_eq!(parse(".roam-ram.42"), Some((Kind::RamMount, 42)));
    assert_eq!(
        parse(".roam-nbd-disk.img.42.sock"),
        Some((Kind::NbdSocket, 42))
    );
    assert_eq!(parse(".roam-resume-qmp.42"), Some((Kind::QmpSocket, 42)));
    assert_eq!(parse(".disk.img.roam-resume.42"), Some((Kind::CopyIn, 42)));
    assert_eq!(
        parse(".vm-ram.roam-demand.42"),
        Some((Kind::DemandCache, 42))
    );
    for name in [
        ".roam-ram.0",
        ".roam-ram.+4",
        ".roam-ram.",
        ".roam-nbd-.42.sock",
        ".roam-nbd-disk.42",
        "..roam-resume.42",
        ".disk.img.roam-resume.4x",
        "disk.img.roam-resume.42",
        ".disk.img.roam-suspend.42",
        ".roam-ram.99999999999",
    ] {
        assert_eq!(parse(name), None, "{name}");
    }
}

#[test]
fn mountinfo_paths_are_unescaped() {
    let info =
        "36 35 0:45 / /tmp/a\\040b/.roam-ram.7 rw,nosuid,nodev shared:1 - fuse roam-memory rw\n\
                37 35 0:46 / /tmp/other rw - fuse roam-memory rw\n";
    let m = mounts_at(info, Path::new("/tmp/a b/.roam-ram.7"));
    assert_eq!(m.len(), 1);
    assert_eq!((m[0].dev, m[0].fstype.as_str()), (45, "fuse"));
    assert_eq!(m[0].source, "roam-memory");
}
