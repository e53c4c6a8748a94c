//! End-to-end tests of `roam hoard` (ISR's fully proactive hoarding) and
//! of `roam resume --lookaside` given a hoard: the real binary, a real
//! store (a local directory, and a `roam store serve` reached as
//! `roam://` through a loopback proxy that counts the bytes), two sites
//! (state directories; B holds a copy of A's store secret).
//!
//! - B hoards version 1; A suspends version 2; B resumes from the stale
//!   hoard: every byte is version 2's, and only version 2's 2 new chunks
//!   come from the store; hoarding again fetches those 2 only, after which
//!   a resume fetches nothing; a chunk altered in the hoard is not used
//!   (fetched instead, the result still right) and the next hoard repairs
//!   it; a hoard is refused as a resume's DIR;
//! - SIGINT mid-hoard leaves the previous version's hoard whole, no
//!   partial files (the store server 200 ms away, so chunks are in flight);
//! - `--follow` hoards version 2 within a bounded time of its suspend and
//!   stops cleanly on SIGTERM (exit 0, no lock or partial files left);
//! - errors are precise: unknown environment (no directory made), wrong
//!   secret, a directory of other files, another environment's hoard, a
//!   path that is a file, a hoard locked by a live process, a bad
//!   --interval.
//!
//! Images are seeded random bytes (`ROAM_TEST_SEED` replays a run).

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{free_port, keygen, random, roam, sha, wait_for_port, Guard};
use roam_sim::proxy::FaultProxy;

/// 128 KiB, roam-store's chunk size.
const CHUNK: usize = 128 * 1024;

/// Chunks of the disk (4 MiB) and of the memory image (512 KiB).
const DISK_CHUNKS: usize = 32;
const MEMORY_CHUNKS: usize = 4;
const TOTAL: u64 = (DISK_CHUNKS + MEMORY_CHUNKS) as u64;

/// This file's default seed (`common::seed`).
const SEED: u64 = 0x5eed_40a2;

/// The run's seed (`$ROAM_TEST_SEED` or [`SEED`]).
fn seed() -> u64 {
    common::seed(SEED)
}

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_owned()
}

/// Two sites sharing a store: A suspends, B hoards and resumes.
struct Sites {
    /// Holds everything.
    dir: tempfile::TempDir,
    /// `--store VALUE` for every command.
    store: String,
    /// The images as A last suspended them.
    disk: Vec<u8>,
    memory: Vec<u8>,
    rng: u64,
}

impl Sites {
    /// A's state and images, B's state, and a store `store` (a directory
    /// under the sites' directory if `None`).
    fn new(store: Option<String>, dir: tempfile::TempDir) -> Sites {
        for sub in ["a/env", "b"] {
            std::fs::create_dir_all(dir.path().join(sub)).unwrap();
        }
        let store = store.unwrap_or_else(|| path(&dir.path().join("store")));
        let mut rng = seed();
        let disk = random(&mut rng, DISK_CHUNKS * CHUNK);
        let memory = random(&mut rng, MEMORY_CHUNKS * CHUNK);
        Sites {
            dir,
            store,
            disk,
            memory,
            rng,
        }
    }

    fn a(&self) -> PathBuf {
        self.dir.path().join("a")
    }

    fn b(&self) -> PathBuf {
        self.dir.path().join("b")
    }

    /// `roam ARGS --store STORE` at `site`.
    fn run(&self, site: &Path, args: &[&str]) -> Output {
        roam(site)
            .args(args)
            .args(["--store", &self.store])
            .env("XDG_CONFIG_HOME", site.join("no-config"))
            .output()
            .unwrap()
    }

    /// `run`, expecting exit 0; stdout.
    fn ok(&self, site: &Path, args: &[&str]) -> String {
        let out = self.run(site, args);
        assert!(
            out.status.success(),
            "roam {args:?}: {:?}\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `run`, expecting exit `code` and `needle` in the error line (stderr
    /// without progress lines: one line for exit 1); that line.
    fn fails(&self, site: &Path, args: &[&str], code: i32, needle: &str) -> String {
        let out = self.run(site, args);
        let stderr = String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter(|l| !l.starts_with("roam: ["))
            .collect::<Vec<_>>()
            .join("\n");
        assert_eq!(out.status.code(), Some(code), "roam {args:?}: {stderr}");
        assert!(
            stderr.contains(needle),
            "roam {args:?}: {stderr:?} lacks {needle:?}"
        );
        if code == 1 {
            assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
        }
        stderr
    }

    /// A suspends the images as they are now (the next version); the
    /// first suspend makes the secret, which B then gets a copy of (the
    /// user carries it).
    fn suspend(&self) {
        std::fs::write(self.a().join("env/disk"), &self.disk).unwrap();
        std::fs::write(self.a().join("env/memory"), &self.memory).unwrap();
        let (d, m) = (self.a().join("env/disk"), self.a().join("env/memory"));
        self.ok(
            &self.a(),
            &["suspend", "--env", "lab", &path(&d), &path(&m)],
        );
        if !self.b().join("store.secret").exists() {
            std::fs::copy(self.a().join("store.secret"), self.b().join("store.secret")).unwrap();
        }
    }

    /// Rewrites disk chunks `a` and `b` (version 2 differs in 2 chunks).
    fn change_two_chunks(&mut self, a: usize, b: usize) {
        for i in [a, b] {
            let fresh = random(&mut self.rng, CHUNK);
            self.disk[i * CHUNK..(i + 1) * CHUNK].copy_from_slice(&fresh);
        }
    }

    /// Resumes the environment at `site` into `site/into` with `hoard` as
    /// its lookaside, checks the images are what A last suspended
    /// (`what` names the case) and returns roam's output.
    fn resume_from_hoard(&self, site: &Path, hoard: &Path, into: &str, what: &str) -> String {
        let dir = site.join(into);
        let out = self.ok(
            site,
            &[
                "resume",
                "--env",
                "lab",
                "--lookaside",
                &path(hoard),
                &path(&dir),
            ],
        );
        self.check(&dir, what);
        out
    }

    /// `dir/disk` and `dir/memory` are the images A last suspended.
    fn check(&self, dir: &Path, what: &str) {
        for (name, bytes) in [("disk", &self.disk), ("memory", &self.memory)] {
            let got = std::fs::read(dir.join(name)).unwrap();
            assert_eq!(got.len(), bytes.len(), "{what}: {name} length");
            assert_eq!(sha(&got), sha(bytes), "{what}: {name} sha256");
        }
    }
}

/// The number before `label` in `text`.
fn number_before(text: &str, label: &str) -> u64 {
    let at = text
        .find(label)
        .unwrap_or_else(|| panic!("{label:?} not in {text}"));
    text[..at]
        .split_whitespace()
        .last()
        .and_then(|n| n.trim_start_matches('(').parse().ok())
        .unwrap_or_else(|| panic!("no number before {label:?} in {text}"))
}

/// A hoard's summary line: (version, chunks, fetched, object bytes
/// fetched, already here).
fn hoard_counts(out: &str) -> (u64, u64, u64, u64, u64) {
    let line = out
        .lines()
        .find(|l| l.starts_with("hoarded lab version "))
        .unwrap_or_else(|| panic!("no summary line in {out:?}"));
    assert_eq!(out.lines().count(), 1, "one line: {out}");
    (
        number_before(line, "from "),
        number_before(line, "chunks,"),
        number_before(line, "fetched"),
        number_before(line, "bytes of objects"),
        number_before(line, "already here"),
    )
}

/// A resume's lookaside line: (taken locally, fetched, object bytes).
fn lookaside_counts(out: &str) -> (u64, u64, u64) {
    let line = out
        .lines()
        .find(|l| l.contains("taken locally"))
        .unwrap_or_else(|| panic!("no lookaside line in {out}"));
    let hits = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    (
        hits,
        number_before(line, "chunks and"),
        number_before(line, "bytes of objects"),
    )
}

/// What a hoard directory holds besides its images: nothing left over.
fn check_clean(hoard: &Path) {
    let mut names: Vec<String> = std::fs::read_dir(hoard)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["HOARD", "images"], "no lock or partial images left");
}

/// The version `hoard/HOARD` names.
fn marker_version(hoard: &Path) -> u64 {
    let text = std::fs::read_to_string(hoard.join("HOARD")).unwrap();
    assert!(text.starts_with("roam hoard: "), "{text}");
    assert!(text.contains("\nenv: lab\n"), "{text}");
    let line = text.lines().find(|l| l.starts_with("version: ")).unwrap();
    line["version: ".len()..].parse().unwrap()
}

/// Hoard v1 at B; v2 suspended at A; resumes at B from the stale and the
/// fresh hoard, then from a tampered one; returns the (stale resume,
/// second hoard) outputs. `fetched_bytes` reads how many bytes the store
/// has sent so far (the proxy's count), if it can.
fn hoard_scenario(s: &mut Sites, fetched_bytes: &dyn Fn() -> Option<u64>) -> (String, String) {
    let b = s.b();
    let hoard = b.join("hoard");
    s.suspend();

    // Hoard version 1: everything fetched; again: nothing.
    let first = s.ok(&b, &["hoard", "--env", "lab", &path(&hoard)]);
    assert_eq!(
        hoard_counts(&first),
        (1, TOTAL, TOTAL, hoard_counts(&first).3, 0)
    );
    assert!(hoard_counts(&first).3 >= TOTAL * CHUNK as u64, "{first}");
    s.check(&hoard.join("images"), "hoard of version 1");
    assert_eq!(marker_version(&hoard), 1);
    check_clean(&hoard);
    let again = s.ok(&b, &["hoard", "--env", "lab", &path(&hoard)]);
    assert_eq!(hoard_counts(&again), (1, TOTAL, 0, 0, TOTAL), "{again}");

    // A hoard is no place to resume into.
    s.fails(
        &b,
        &["resume", "--env", "lab", &path(&hoard)],
        1,
        "is a hoard of lab version 1",
    );

    // Version 2, suspended at A: 2 disk chunks differ.
    let v1 = (s.disk.clone(), s.memory.clone());
    s.change_two_chunks(3, 20);
    s.suspend();

    // Resume at B from the stale hoard: version 2's bytes, 2 chunks fetched.
    let before = fetched_bytes();
    let stale = s.resume_from_hoard(&b, &hoard, "r1", "resumed from the stale hoard");
    let (hits, fetched, objects) = lookaside_counts(&stale);
    assert_eq!((hits, fetched), (TOTAL - 2, 2), "{stale}");
    assert!(
        objects >= 2 * CHUNK as u64 && objects < 3 * CHUNK as u64,
        "{stale}"
    );
    if let (Some(before), Some(after)) = (before, fetched_bytes()) {
        // The chunks' objects, the manifest and the protocol's framing.
        let down = after - before;
        eprintln!("resume from the stale hoard: {down} bytes from the store server");
        assert!(
            down >= objects && down < objects + 64 * 1024,
            "{down} bytes down: {stale}"
        );
    }
    // The resume read the hoard, it did not change it.
    let hoarded = std::fs::read(hoard.join("images/disk")).unwrap();
    assert_eq!(sha(&hoarded), sha(&v1.0), "the hoard still holds version 1");

    // Hoard version 2: only its 2 new chunks fetched; then a resume
    // fetches nothing.
    let second = s.ok(&b, &["hoard", "--env", "lab", &path(&hoard)]);
    let (version, chunks, fetched, objects, here) = hoard_counts(&second);
    assert_eq!(
        (version, chunks, fetched, here),
        (2, TOTAL, 2, TOTAL - 2),
        "{second}"
    );
    assert!(
        objects >= 2 * CHUNK as u64 && objects < 3 * CHUNK as u64,
        "{second}"
    );
    s.check(&hoard.join("images"), "hoard of version 2");
    assert_eq!(marker_version(&hoard), 2);
    check_clean(&hoard);
    let fresh = s.resume_from_hoard(&b, &hoard, "r2", "resumed from the fresh hoard");
    assert_eq!(lookaside_counts(&fresh), (TOTAL, 0, 0), "{fresh}");

    // One byte of the hoard's disk altered (chunk 7): that chunk is not
    // used, the resume still writes version 2; the next hoard repairs it.
    let mut bad = s.disk.clone();
    bad[7 * CHUNK + 4321] ^= 0x40;
    std::fs::write(hoard.join("images/disk"), &bad).unwrap();
    let out = s.resume_from_hoard(&b, &hoard, "r3", "resumed from a tampered hoard");
    let (hits, fetched, _) = lookaside_counts(&out);
    assert_eq!((hits, fetched), (TOTAL - 1, 1), "{out}");
    let repair = s.ok(&b, &["hoard", "--env", "lab", &path(&hoard)]);
    let (version, _, fetched, _, here) = hoard_counts(&repair);
    assert_eq!((version, fetched, here), (2, 1, TOTAL - 1), "{repair}");
    s.check(&hoard.join("images"), "repaired hoard");
    (stale, second)
}

#[test]
fn hoard_then_resume_from_a_stale_fresh_and_tampered_hoard() {
    let mut s = Sites::new(None, tempfile::tempdir().unwrap());
    let (stale, second) = hoard_scenario(&mut s, &|| None);
    eprintln!("local store: stale-hoard resume:\n{stale}second hoard:\n{second}");
    let help = s.ok(&s.b(), &["hoard", "--help"]);
    assert!(help.contains("--follow"), "{help}");
    assert!(
        help.contains("roam resume --env laptop --lookaside"),
        "{help}"
    );
}

/// The scenario through `roam store serve` (`roam://`) behind a proxy
/// that counts the bytes the server sends: the stale-hoard resume takes
/// no more than its 2 chunks' objects (and the protocol's bytes) from it.
#[test]
fn hoard_through_a_store_server() {
    let (server, proxy, mut s) = store_server();
    hoard_scenario(&mut s, &|| Some(proxy.stats().bytes_down));
    drop(server);
}

/// A `roam store serve` admitting sites A and B, behind a fault proxy, and
/// the sites using it as `roam://`.
fn store_server() -> (Guard, FaultProxy, Sites) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for sub in ["a", "b", "server", "holder"] {
        std::fs::create_dir_all(d.join(sub)).unwrap();
    }
    let keys = format!("{}\n{}\n", keygen(&d.join("a")), keygen(&d.join("b")));
    std::fs::write(d.join("authorized"), keys).unwrap();
    let port = free_port();
    let server = Guard(
        roam(&d.join("server"))
            .args(["store", "serve", "--listen", &format!("127.0.0.1:{port}")])
            .arg("--store")
            .arg(d.join("holder"))
            .arg("--authorized-keys")
            .arg(d.join("authorized"))
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for_port(port);
    let proxy = FaultProxy::spawn(([127, 0, 0, 1], port).into()).unwrap();
    let s = Sites::new(Some(format!("roam://{}", proxy.addr())), dir);
    (server, proxy, s)
}

/// SIGINT while version 2 is being hoarded (the store 200 ms away each
/// way, so its chunks are still on their way): exit 1 naming the signal,
/// the hoard still version 1, whole, with no partial files or lock left;
/// the next hoard takes version 2.
#[test]
fn a_signal_mid_hoard_leaves_the_previous_hoard() {
    let (server, proxy, mut s) = store_server();
    let b = s.b();
    let hoard = b.join("hoard");
    s.suspend();
    s.ok(&b, &["hoard", "--env", "lab", &path(&hoard)]);
    let v1 = s.disk.clone();
    s.change_two_chunks(8, 9);
    s.suspend();
    proxy.set_delay(Duration::from_millis(200));
    let mut child = Guard(
        roam(&b)
            .args(["hoard", "--env", "lab"])
            .arg(&hoard)
            .args(["--store", &s.store])
            .env("XDG_CONFIG_HOME", b.join("no-config"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let (tx, rx) = mpsc::channel();
    let stderr = child.0.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if line.contains("hoarding lab version 2") {
                let _ = tx.send(());
            }
            all += &line;
            all.push('\n');
        }
        all
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the hoard of version 2 began");
    child.signal("INT");
    let code = child.wait_exit(Duration::from_secs(10));
    let stderr = reader.join().unwrap();
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "interrupted by signal 2 while hoarding lab version 2: its partial images were \
             removed; the hoard holds lab version 1 as before"
        ),
        "{stderr}"
    );
    assert!(
        !stderr.contains("] disk: done"),
        "interrupted mid-way: {stderr}"
    );
    check_clean(&hoard);
    assert_eq!(marker_version(&hoard), 1);
    let disk = std::fs::read(hoard.join("images/disk")).unwrap();
    assert_eq!(sha(&disk), sha(&v1), "version 1's disk, whole");
    proxy.set_delay(Duration::ZERO);
    let out = s.ok(&b, &["hoard", "--env", "lab", &path(&hoard)]);
    let (version, _, fetched, _, _) = hoard_counts(&out);
    assert_eq!((version, fetched), (2, 2), "{out}");
    s.check(&hoard.join("images"), "hoard after the interrupted one");
    drop(server);
}

/// Lines of a child's stdout, as they come.
fn lines_of(child: &mut Guard) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    let stdout = child.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

#[test]
fn follow_hoards_a_new_version_and_stops_on_sigterm() {
    let mut s = Sites::new(None, tempfile::tempdir().unwrap());
    s.suspend();
    let b = s.b();
    let hoard = b.join("hoard");
    let mut child = Guard(
        roam(&b)
            .args(["hoard", "--env", "lab", "--follow", "--interval", "200ms"])
            .arg(&hoard)
            .args(["--store", &s.store])
            .env("XDG_CONFIG_HOME", b.join("no-config"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let lines = lines_of(&mut child);
    let first = lines
        .recv_timeout(Duration::from_secs(60))
        .expect("version 1 hoarded within 60 s");
    assert_eq!(hoard_counts(&first).0, 1, "{first}");
    s.check(&hoard.join("images"), "followed hoard, version 1");

    s.change_two_chunks(5, 6);
    s.suspend();
    let suspended = Instant::now();
    let second = lines
        .recv_timeout(Duration::from_secs(30))
        .expect("version 2 hoarded within 30 s of its suspend");
    let took = suspended.elapsed();
    eprintln!("--follow --interval 200ms hoarded version 2 {took:?} after its suspend");
    let (version, _, fetched, _, here) = hoard_counts(&second);
    assert_eq!((version, fetched, here), (2, 2, TOTAL - 2), "{second}");
    s.check(&hoard.join("images"), "followed hoard, version 2");
    assert_eq!(marker_version(&hoard), 2);

    child.signal("TERM");
    let code = child.wait_exit(Duration::from_secs(10));
    let mut stderr = String::new();
    if let Some(mut e) = child.0.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut stderr);
    }
    assert_eq!(code, Some(0), "stopped cleanly within 10 s: {stderr}");
    assert!(
        stderr.contains("stopped by signal 15: the hoard holds lab version 2"),
        "{stderr}"
    );
    assert!(lines.try_recv().is_err(), "no further summary line");
    check_clean(&hoard);
}

#[test]
fn hoard_errors_are_precise() {
    let s = Sites::new(None, tempfile::tempdir().unwrap());
    s.suspend();
    let b = s.b();
    let work = s.dir.path().to_owned();

    let nowhere = work.join("h-unknown");
    s.fails(
        &b,
        &["hoard", "--env", "nope", &path(&nowhere)],
        1,
        "no environment nope in the store",
    );
    assert!(
        !nowhere.exists(),
        "no directory made for an unknown environment"
    );

    let wrong = work.join("wrong.secret");
    std::fs::write(&wrong, [7u8; 32]).unwrap();
    s.fails(
        &b,
        &[
            "hoard",
            "--env",
            "lab",
            "--secret",
            &path(&wrong),
            &path(&work.join("h-wrong")),
        ],
        1,
        "was not sealed with this secret",
    );

    let other = work.join("h-other");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("notes.txt"), "mine").unwrap();
    s.fails(
        &b,
        &["hoard", "--env", "lab", &path(&other)],
        1,
        "holds other files (notes.txt) and is no hoard",
    );
    assert_eq!(
        std::fs::read_dir(&other).unwrap().count(),
        1,
        "left as it was"
    );

    let file = work.join("h-file");
    std::fs::write(&file, "x").unwrap();
    s.fails(
        &b,
        &["hoard", "--env", "lab", &path(&file)],
        1,
        "is not a directory",
    );
    s.fails(
        &b,
        &["hoard", "--env", "lab", &path(&file.join("sub"))],
        1,
        "sub as a hoard: Not a directory",
    );

    // A hoard of lab, then asked to hold another environment.
    let hoard = work.join("h-lab");
    s.ok(&b, &["hoard", "--env", "lab", &path(&hoard)]);
    let text = std::fs::read_to_string(hoard.join("HOARD")).unwrap();
    std::fs::write(hoard.join("HOARD"), text.replace("env: lab", "env: other")).unwrap();
    s.fails(
        &b,
        &["hoard", "--env", "lab", &path(&hoard)],
        1,
        "is a hoard of environment other, not lab",
    );
    std::fs::write(hoard.join("HOARD"), &text).unwrap();

    // Locked by a live process (this test's): refused, lock kept; a lock
    // whose process is gone is taken over.
    std::fs::write(hoard.join(".lock"), format!("{}\n", std::process::id())).unwrap();
    s.fails(
        &b,
        &["hoard", "--env", "lab", &path(&hoard)],
        1,
        &format!("is being hoarded into by process {}", std::process::id()),
    );
    assert!(hoard.join(".lock").exists());
    std::fs::write(hoard.join(".lock"), "4194999\n").unwrap();
    s.ok(&b, &["hoard", "--env", "lab", &path(&hoard)]);
    check_clean(&hoard);

    s.fails(
        &b,
        &[
            "hoard",
            "--env",
            "lab",
            "--follow",
            "--interval",
            "5ms",
            &path(&hoard),
        ],
        2,
        "invalid --interval \"5ms\"",
    );
}

/// `--version N` hoards an older version over a newer hoard: only the
/// chunks the hoard lacks are fetched, the images are version N's, the
/// marker says N; a version the store lacks is refused naming those it
/// has, before any directory is made; `--follow` cannot be given with it.
#[test]
fn an_older_version_is_hoarded_on_request() {
    let mut s = Sites::new(None, tempfile::tempdir().unwrap());
    let b = s.b();
    let hoard = b.join("hoard");
    s.suspend();
    let v1_disk = s.disk.clone();
    s.change_two_chunks(2, 5);
    s.suspend();
    let out = s.ok(&b, &["hoard", "--env", "lab", &path(&hoard)]);
    assert_eq!(hoard_counts(&out).0, 2, "the newest by default: {out}");
    s.check(&hoard.join("images"), "hoard of version 2");

    let out = s.ok(
        &b,
        &["hoard", "--env", "lab", "--version", "1", &path(&hoard)],
    );
    let (version, chunks, fetched, _, already) = hoard_counts(&out);
    assert_eq!((version, fetched), (1, 2), "{out}");
    assert_eq!(already, chunks - 2, "{out}");
    assert_eq!(marker_version(&hoard), 1);
    check_clean(&hoard);
    let disk = std::fs::read(hoard.join("images/disk")).unwrap();
    assert_eq!(sha(&disk), sha(&v1_disk), "version 1's disk");
    let memory = std::fs::read(hoard.join("images/memory")).unwrap();
    assert_eq!(sha(&memory), sha(&s.memory), "the memory, as in both");

    let fresh = b.join("h-none");
    s.fails(
        &b,
        &["hoard", "--env", "lab", "--version", "7", &path(&fresh)],
        1,
        "environment lab has no version 7 in",
    );
    let line = s.fails(
        &b,
        &["hoard", "--env", "lab", "--version", "7", &path(&hoard)],
        1,
        "(it has 1, 2)",
    );
    assert!(!fresh.exists(), "no directory made: {line}");
    assert_eq!(marker_version(&hoard), 1, "the hoard left as it was");
    s.fails(
        &b,
        &[
            "hoard",
            "--env",
            "lab",
            "--version",
            "1",
            "--follow",
            &path(&hoard),
        ],
        2,
        "cannot be used with",
    );
}
