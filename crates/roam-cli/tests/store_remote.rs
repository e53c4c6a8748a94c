//! End-to-end tests of a store reached through a roam session: `roam store
//! serve` in front of a directory (the store holder), and `roam suspend` /
//! `roam resume` / `roam store list` with `--store roam://HOST:PORT`
//! through a loopback fault proxy ([`roam_sim::proxy::FaultProxy`]).
//!
//! - a resume whose network dies silently mid-transfer (the proxy
//!   black-holes the connection in use) finishes once the session resumes
//!   on a new connection, and every byte is the suspended one (SHA-256);
//!   the store holder's files contain no plaintext of the image;
//! - a server whose key is not the pinned one, and a client whose key the
//!   server does not authorize, are refused with precise errors;
//! - a store server unreachable for longer than `--store-timeout` is an
//!   error naming it, in bounded time;
//! - each command ends its session: the server's `roam status` lists it
//!   while the command runs and no longer once it has exited, failed or not;
//! - a suspend whose network dies mid-upload (black-holed, reset) finishes,
//!   every byte resumable; one whose network stays down past
//!   `--store-timeout` fails naming the store server, writes no version,
//!   and the next suspend works.
//!
//! Images are seeded random bytes (`ROAM_TEST_SEED` replays a run).

mod common;

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, keygen, random, roam, sha, status_json, wait_for_port, Guard};
use roam_sim::proxy::FaultProxy;

/// A string written into the image at several places; the store holder's
/// files must not contain it.
const MARKER: &[u8] = b"ROAM-ISR-PLAINTEXT-MARKER-7d1f";

/// This file's default seed (`common::seed`).
const SEED: u64 = 0x5eed_5107;

/// The run's seed (`$ROAM_TEST_SEED` or [`SEED`]).
fn seed() -> u64 {
    common::seed(SEED)
}

/// `len` pseudo-random bytes (splitmix64 from `state`) with [`MARKER`]
/// written every MiB.
fn image(mut state: u64, len: usize) -> Vec<u8> {
    let mut out = random(&mut state, len);
    for at in (1000..len.saturating_sub(MARKER.len())).step_by(1 << 20) {
        out[at..at + MARKER.len()].copy_from_slice(MARKER);
    }
    out
}

/// Whether `needle` occurs in `hay`.
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// `roam ARGS` in the client state directory `state`; its output.
fn run(state: &Path, args: &[&str]) -> Output {
    roam(state)
        .args(args)
        .env("XDG_CONFIG_HOME", state.join("no-config"))
        .output()
        .unwrap()
}

/// Runs `roam ARGS`, expecting success; returns stdout.
fn ok(state: &Path, args: &[&str]) -> String {
    let out = run(state, args);
    assert!(
        out.status.success(),
        "roam {args:?}: {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `roam ARGS`, expecting exit 1 with `needles` on stderr and no word
/// of a relay (a store client's errors name the store server); returns
/// stderr.
fn fails(state: &Path, args: &[&str], needles: &[&str]) -> String {
    let out = run(state, args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(1),
        "roam {args:?}: stderr: {stderr}"
    );
    for n in needles {
        assert!(stderr.contains(n), "roam {args:?}: {stderr:?} lacks {n:?}");
    }
    assert!(
        !stderr.to_lowercase().contains("relay"),
        "roam {args:?}: {stderr:?} speaks of a relay"
    );
    stderr
}

/// A running `roam store serve` and its port.
struct Server {
    /// The process (killed when dropped).
    _proc: Guard,
    /// Its loopback port.
    port: u16,
}

/// Starts `roam store serve` with its state in `state`, its objects in
/// `holder`, admitting the keys in `authorized`.
fn start_server(state: &Path, holder: &Path, authorized: &Path) -> Server {
    let port = free_port();
    let proc = roam(state)
        .args(["store", "serve", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--store")
        .arg(holder)
        .arg("--authorized-keys")
        .arg(authorized)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let server = Server {
        _proc: Guard(proc),
        port,
    };
    wait_for_port(port);
    server
}

/// Two client machines (state directories with their own keys), a store
/// server admitting both, and a fault proxy in front of it.
struct World {
    /// Holds every directory.
    dir: tempfile::TempDir,
    /// The store server.
    server: Server,
    /// The proxy clients reach it through.
    proxy: FaultProxy,
}

impl World {
    fn new() -> World {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for sub in ["a", "b", "server", "holder"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        let keys = format!("{}\n{}\n", keygen(&d.join("a")), keygen(&d.join("b")));
        std::fs::write(d.join("authorized"), keys).unwrap();
        let server = start_server(&d.join("server"), &d.join("holder"), &d.join("authorized"));
        let proxy = FaultProxy::spawn(([127, 0, 0, 1], server.port).into()).unwrap();
        World { dir, server, proxy }
    }

    /// A client machine's state directory.
    fn site(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }

    /// `roam://` of the proxy.
    fn store(&self) -> String {
        format!("roam://{}", self.proxy.addr())
    }
}

/// Starts `roam resume` of `work` at site `b` into `b/<into>` through the
/// world's proxy (stderr piped), and returns once a quarter of the image's
/// `len` bytes have come down through the proxy, the resume still running.
fn resume_until_a_quarter(w: &World, b: &Path, into: &str, len: usize) -> Guard {
    let mut cmd = roam(b);
    cmd.args(["resume", "--env", "work", "--store", &w.store()])
        .arg(b.join(into))
        .env("XDG_CONFIG_HOME", b.join("no-config"));
    until_a_quarter(w, cmd, &format!("the resume into {into}"), len, |s| {
        s.bytes_down
    })
}

/// Spawns `cmd` (a roam command through the world's proxy; stdout
/// discarded, stderr piped) and returns once a quarter of `len` bytes more
/// than before have gone through the proxy as `moved` counts them (up or
/// down), `what` still running.
fn until_a_quarter(
    w: &World,
    mut cmd: std::process::Command,
    what: &str,
    len: usize,
    moved: fn(&roam_sim::proxy::ProxyStats) -> u64,
) -> Guard {
    let before = moved(&w.proxy.stats());
    let mut child = Guard(
        cmd.stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while moved(&w.proxy.stats()) < before + (len as u64) / 4 {
        assert!(
            child.0.try_wait().unwrap().is_none(),
            "{what} ended before the fault"
        );
        assert!(Instant::now() < deadline, "{what} never got going");
        std::thread::sleep(Duration::from_millis(1));
    }
    child
}

/// Suspend at A, resume at B through the store server; a second resume at
/// B has its connection black-holed after a quarter of the image came down,
/// a third has it reset, and each still restores every byte.
#[test]
fn resume_survives_network_drop() {
    let w = World::new();
    let (a, b) = (w.site("a"), w.site("b"));
    let len = 24 << 20;
    let img = image(seed(), len);
    assert!(contains(&img, MARKER));
    let want = sha(&img);
    std::fs::create_dir_all(a.join("env")).unwrap();
    std::fs::write(a.join("env/disk.img"), &img).unwrap();
    let store = w.store();
    let t = Instant::now();
    ok(
        &a,
        &[
            "suspend",
            "--env",
            "work",
            "--store",
            &store,
            a.join("env/disk.img").to_str().unwrap(),
        ],
    );
    eprintln!("suspend of {} MiB: {:?}", len >> 20, t.elapsed());

    // The store holder sees sealed objects only.
    let stored = files_under(&w.dir.path().join("holder"));
    assert!(stored.len() > len / (128 << 10), "{} objects", stored.len());
    for f in &stored {
        let bytes = std::fs::read(f).unwrap();
        assert!(!contains(&bytes, MARKER), "plaintext in {}", f.display());
    }

    // B holds the user's secret (the user carried it), nothing else.
    std::fs::copy(a.join("store.secret"), b.join("store.secret")).unwrap();
    let listed = ok(&b, &["store", "list", "--store", &store]);
    assert!(listed.contains("work"), "{listed}");

    // A clean resume, for the time it takes.
    let t = Instant::now();
    ok(
        &b,
        &[
            "resume",
            "--env",
            "work",
            "--store",
            &store,
            b.join("clean").to_str().unwrap(),
        ],
    );
    let clean = t.elapsed();
    assert_eq!(sha(&std::fs::read(b.join("clean/disk.img")).unwrap()), want);

    // The resume whose network dies: the connection in use goes silent
    // for good once a quarter of the image has come down; a new one works.
    let before = w.proxy.stats();
    let t = Instant::now();
    let mut child = resume_until_a_quarter(&w, &b, "dropped", len);
    w.proxy.blackhole_current();
    let dropped_at = t.elapsed();
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "the resume ended before the drop"
    );
    let code = child.wait_exit(Duration::from_secs(60));
    let mut stderr = String::new();
    if let Some(mut e) = child.0.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut stderr);
    }
    assert_eq!(code, Some(0), "the resume failed: {stderr}");
    let dropped = t.elapsed();
    let after = w.proxy.stats();
    assert!(
        after.accepted > before.accepted + 1,
        "the session never re-dialled: {before:?} {after:?}"
    );
    assert_eq!(
        sha(&std::fs::read(b.join("dropped/disk.img")).unwrap()),
        want,
        "the resumed image differs"
    );

    // The connection reset mid-transfer instead: the session re-dials at
    // once.
    let before = w.proxy.stats();
    let t = Instant::now();
    let mut child = resume_until_a_quarter(&w, &b, "reset", len);
    w.proxy.reset_all();
    assert_eq!(child.wait_exit(Duration::from_secs(60)), Some(0));
    let reset = t.elapsed();
    assert!(w.proxy.stats().accepted > before.accepted + 1);
    assert_eq!(sha(&std::fs::read(b.join("reset/disk.img")).unwrap()), want);
    eprintln!(
        "resume of {} MiB: {clean:?} clean; {dropped:?} with the network black-holed at \
         {dropped_at:?}; {reset:?} with the connection reset",
        len >> 20
    );
}

/// A server with another key than the pinned one is refused with the
/// key-change warning; a client key the server does not list is refused
/// with the line to add; a first use says whose key it trusts. Each message
/// names the store server, none a relay.
#[test]
fn wrong_keys_are_refused() {
    let w = World::new();
    let a = w.site("a");
    let store = format!("roam://127.0.0.1:{}", w.server.port);
    // A pinned this address with a key that is not the server's.
    let other = w.dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    let wrong = keygen(&other);
    std::fs::write(
        a.join("known_servers"),
        format!("127.0.0.1:{} {wrong}\n", w.server.port),
    )
    .unwrap();
    let file = w.dir.path().join("small");
    std::fs::write(&file, b"small").unwrap();
    let suspend = |store: &str| {
        [
            "suspend",
            "--env",
            "small",
            "--store",
            store,
            file.to_str().unwrap(),
        ]
        .map(str::to_owned)
    };
    let args = suspend(&store);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let err = fails(
        &a,
        &args,
        &[
            "HAS CHANGED",
            &store,
            &wrong,
            "Refusing to connect",
            "the store server's key was replaced",
            "If you know the store server was re-keyed",
        ],
    );
    eprintln!("{err}");

    // A client whose key is not authorized (its own fresh key).
    let c = w.dir.path().join("c");
    std::fs::create_dir_all(&c).unwrap();
    let key = keygen(&c);
    let refused = format!("the store server {store} refused our client key");
    let err = fails(&c, &args, &[&refused, "--authorized-keys", &key]);
    eprintln!("{err}");
    // Nothing reached the store.
    assert!(files_under(&w.dir.path().join("holder")).is_empty());

    // First use: the key trusted is the store server's.
    let out = run(&w.site("b"), &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("trusting the store server {store} on first use")),
        "{stderr}"
    );
    assert!(!stderr.to_lowercase().contains("relay"), "{stderr}");
}

/// A port where nothing listens is "cannot reach the store server", with
/// what to check.
#[test]
fn closed_port_names_the_store_server() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("roam://127.0.0.1:{}", free_port());
    let file = dir.path().join("small");
    std::fs::write(&file, b"small").unwrap();
    let err = fails(
        dir.path(),
        &[
            "suspend",
            "--env",
            "small",
            "--store",
            &store,
            file.to_str().unwrap(),
        ],
        &[
            &format!("cannot reach the store server {store}"),
            "Connection refused",
            "`roam store serve` runs there",
        ],
    );
    eprintln!("{err}");
}

/// A store server that stops answering (the path black-holed, new
/// connections included) is an error naming it after --store-timeout.
#[test]
fn unreachable_store_times_out() {
    let w = World::new();
    let a = w.site("a");
    let store = w.store();
    std::fs::write(w.dir.path().join("small"), b"small").unwrap();
    ok(
        &a,
        &[
            "suspend",
            "--env",
            "small",
            "--store",
            &store,
            w.dir.path().join("small").to_str().unwrap(),
        ],
    );
    w.proxy.blackhole(true);
    let t = Instant::now();
    fails(
        &a,
        &["store", "list", "--store", &store, "--store-timeout", "2s"],
        &[&store, "did not answer within 2 s", "--store-timeout"],
    );
    let took = t.elapsed();
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(15),
        "{took:?}"
    );
    // Given longer than the handshake's own bound (10 s), the error says
    // the server took the connection and never answered the handshake.
    let t = Instant::now();
    let err = fails(
        &a,
        &["store", "list", "--store", &store, "--store-timeout", "30s"],
        &[
            &format!("the store server {store} accepted the connection but did not answer"),
            "within 10 s",
        ],
    );
    let took = t.elapsed();
    assert!(took < Duration::from_secs(25), "{took:?}: {err}");
    w.proxy.blackhole(false);
    let listed = ok(&a, &["store", "list", "--store", &store]);
    assert!(listed.contains("small"), "{listed}");
}

/// The sessions `roam status --json` lists for the store server whose state
/// directory is `state`.
fn server_sessions(state: &Path) -> Vec<serde_json::Value> {
    let status = status_json(state);
    let procs = status["processes"].as_array().cloned().unwrap_or_default();
    let server = procs
        .iter()
        .find(|p| {
            p["command"]
                .as_str()
                .is_some_and(|c| c.starts_with("store serve"))
        })
        .unwrap_or_else(|| panic!("roam status lists no store server: {status}"));
    server["sessions"].as_array().cloned().unwrap_or_default()
}

/// Waits (at most `limit`) until the store server lists no session; how
/// long that took. Panics with the sessions still listed.
fn sessions_gone(state: &Path, limit: Duration) -> Duration {
    let t = Instant::now();
    loop {
        let sessions = server_sessions(state);
        if sessions.is_empty() {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < limit,
            "the store server still holds {} sessions {:?} after the command: {sessions:?}",
            sessions.len(),
            t.elapsed()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Each command closes its session when it ends: the store server's `roam
/// status` lists the session of a resume while it runs, and none once a
/// suspend, a resume, a list or a failed resume has exited (within 2 s;
/// without the close, 60 s).
#[test]
fn commands_end_their_sessions() {
    let w = World::new();
    let (a, b) = (w.site("a"), w.site("b"));
    let server = w.site("server");
    let store = w.store();
    let len = 8 << 20;
    let img = image(seed() ^ 1, len);
    std::fs::create_dir_all(a.join("env")).unwrap();
    std::fs::write(a.join("env/disk.img"), &img).unwrap();
    assert!(server_sessions(&server).is_empty());
    let limit = Duration::from_secs(2);

    let disk = a.join("env/disk.img");
    ok(
        &a,
        &[
            "suspend",
            "--env",
            "work",
            "--store",
            &store,
            disk.to_str().unwrap(),
        ],
    );
    let after_suspend = sessions_gone(&server, limit);

    // While a resume runs, its session is listed, connected.
    std::fs::copy(a.join("store.secret"), b.join("store.secret")).unwrap();
    w.proxy.set_delay(Duration::from_millis(100));
    let mut child = resume_until_a_quarter(&w, &b, "out", len);
    let during = server_sessions(&server);
    assert_eq!(during.len(), 1, "{during:?}");
    assert_eq!(during[0]["state"], "active", "{during:?}");
    w.proxy.set_delay(Duration::ZERO);
    assert_eq!(child.wait_exit(Duration::from_secs(60)), Some(0));
    let after_resume = sessions_gone(&server, limit);
    assert_eq!(
        sha(&std::fs::read(b.join("out/disk.img")).unwrap()),
        sha(&img)
    );

    let listed = ok(&b, &["store", "list", "--store", &store]);
    assert!(listed.contains("work"), "{listed}");
    let after_list = sessions_gone(&server, limit);

    // A command that fails after connecting ends its session too.
    fails(
        &b,
        &[
            "resume",
            "--env",
            "nothing",
            "--store",
            &store,
            b.join("x").to_str().unwrap(),
        ],
        &["no environment nothing"],
    );
    let after_failure = sessions_gone(&server, limit);
    eprintln!(
        "sessions gone after: suspend {after_suspend:?}, resume {after_resume:?}, list \
         {after_list:?}, failed resume {after_failure:?}"
    );
}

/// Starts `roam suspend --env ENV FILE` at site `a` through the world's
/// proxy (with `extra` arguments; stderr piped), and returns once a quarter
/// of the file's `len` bytes have gone up through the proxy, the suspend
/// still running.
fn suspend_until_a_quarter(
    w: &World,
    a: &Path,
    env: &str,
    file: &Path,
    extra: &[&str],
    len: usize,
) -> Guard {
    let mut cmd = roam(a);
    cmd.args(["suspend", "--env", env, "--store", &w.store()])
        .args(extra)
        .arg(file)
        .env("XDG_CONFIG_HOME", a.join("no-config"));
    until_a_quarter(w, cmd, &format!("the suspend of {env}"), len, |s| {
        s.bytes_up
    })
}

/// Waits (at most 60 s) for `child` to exit; its exit code and stderr.
fn exit_and_stderr(mut child: Guard) -> (Option<i32>, String) {
    let code = child.wait_exit(Duration::from_secs(60));
    let mut stderr = String::new();
    if let Some(mut e) = child.0.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut stderr);
    }
    (code, stderr)
}

/// Resumes the newest version of `work` at site `b` into `b/<into>` and
/// returns the SHA-256 of its disk image.
fn resumed_sha(w: &World, b: &Path, into: &str) -> String {
    ok(
        b,
        &[
            "resume",
            "--env",
            "work",
            "--store",
            &w.store(),
            b.join(into).to_str().unwrap(),
        ],
    );
    sha(&std::fs::read(b.join(into).join("disk.img")).unwrap())
}

/// A network drop in the middle of a suspend (the upload): black-holed
/// once a quarter of the image went up, the suspend finishes on a new
/// connection; reset, likewise; each version resumes at B byte for byte.
/// Black-holed for longer than `--store-timeout` (new connections too),
/// the suspend fails with an error naming the store server and the
/// timeout, writes no version, and the store stays usable: once the
/// network is back a suspend stores that image and B resumes it.
#[test]
fn suspend_survives_network_drop() {
    let w = World::new();
    let (a, b) = (w.site("a"), w.site("b"));
    let store = w.store();
    let len = 24 << 20;
    let seed = seed();
    let disk = a.join("env/disk.img");
    std::fs::create_dir_all(a.join("env")).unwrap();
    let img = image(seed ^ 2, len);
    std::fs::write(&disk, &img).unwrap();

    // Version 1: the connection in use goes silent for good mid-upload.
    let before = w.proxy.stats();
    let t = Instant::now();
    let child = suspend_until_a_quarter(&w, &a, "work", &disk, &[], len);
    w.proxy.blackhole_current();
    let dropped_at = t.elapsed();
    let (code, stderr) = exit_and_stderr(child);
    assert_eq!(code, Some(0), "the suspend failed: {stderr}");
    let black_holed = t.elapsed();
    let after = w.proxy.stats();
    assert!(
        after.accepted > before.accepted + 1,
        "the session never re-dialled: {before:?} {after:?}"
    );
    std::fs::copy(a.join("store.secret"), b.join("store.secret")).unwrap();
    assert_eq!(resumed_sha(&w, &b, "v1"), sha(&img), "version 1 differs");

    // Version 2 (every chunk new): the connection reset mid-upload.
    let img = image(seed ^ 3, len);
    std::fs::write(&disk, &img).unwrap();
    let before = w.proxy.stats();
    let t = Instant::now();
    let child = suspend_until_a_quarter(&w, &a, "work", &disk, &[], len);
    w.proxy.reset_all();
    let (code, stderr) = exit_and_stderr(child);
    assert_eq!(code, Some(0), "the suspend failed: {stderr}");
    let reset = t.elapsed();
    assert!(w.proxy.stats().accepted > before.accepted + 1);
    let v2 = sha(&img);
    assert_eq!(resumed_sha(&w, &b, "v2"), v2, "version 2 differs");

    // Version 3 cannot be written: the network stays down past the
    // timeout. The suspend fails, precisely, and no version 3 exists.
    let img = image(seed ^ 4, len);
    std::fs::write(&disk, &img).unwrap();
    let child = suspend_until_a_quarter(&w, &a, "work", &disk, &["--store-timeout", "3s"], len);
    w.proxy.blackhole(true);
    let t = Instant::now();
    let (code, stderr) = exit_and_stderr(child);
    let failed_after = t.elapsed();
    assert_eq!(code, Some(1), "the suspend did not fail: {stderr}");
    for needle in [
        format!("the store server {store} did not answer within 3 s"),
        "--store-timeout".to_string(),
    ] {
        assert!(stderr.contains(&needle), "{stderr:?} lacks {needle:?}");
    }
    assert!(!stderr.to_lowercase().contains("relay"), "{stderr}");
    // The timeout, and no wait for a close the server cannot acknowledge.
    assert!(
        failed_after < Duration::from_millis(5500),
        "{failed_after:?}: {stderr}"
    );
    w.proxy.blackhole(false);
    let listed = ok(&b, &["store", "list", "--env", "work", "--store", &store]);
    assert!(
        listed.contains("version 2") && !listed.contains("version 3"),
        "{listed}"
    );
    // Still at version 2 for a resume.
    assert_eq!(resumed_sha(&w, &b, "still-v2"), v2);

    // The network is back: the same suspend stores version 3, whole.
    ok(
        &a,
        &[
            "suspend",
            "--env",
            "work",
            "--store",
            &store,
            disk.to_str().unwrap(),
        ],
    );
    assert_eq!(resumed_sha(&w, &b, "v3"), sha(&img), "version 3 differs");
    eprintln!(
        "suspend of {} MiB: {black_holed:?} with the network black-holed at {dropped_at:?}; \
         {reset:?} with the connection reset; failed {failed_after:?} after the network went \
         down for good (--store-timeout 3s)",
        len >> 20
    );
}
