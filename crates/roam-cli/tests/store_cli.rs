//! End-to-end tests of `roam suspend`, `roam resume` and `roam store`: the
//! real binary against a local directory store and (with `$ROAM_S3S_FS`)
//! a real S3 server, s3s-fs, on a free 127.0.0.1 port. Images are seeded
//! random bytes (`ROAM_TEST_SEED` replays a run); every resumed file is
//! compared with what was suspended, byte for byte.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{random, sha, BIN};

/// 128 KiB, roam-store's chunk size.
const CHUNK: usize = 128 * 1024;

/// This file's default seed (`common::seed`).
const SEED: u64 = 0x5eed_1234;

/// The run's seed (`$ROAM_TEST_SEED` or [`SEED`]).
fn seed() -> u64 {
    common::seed(SEED)
}

/// `roam ARGS` with the state directory `state` and `envs` set.
fn roam(state: &Path, args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .env("ROAM_STATE_DIR", state)
        .env("XDG_CONFIG_HOME", state.join("no-config"))
        .env_remove("ROAM_S3_ENDPOINT")
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// Runs `roam ARGS`, expecting exit 0; returns stdout.
fn ok(state: &Path, args: &[&str], envs: &[(&str, &str)]) -> String {
    let out = roam(state, args, envs);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "roam {args:?}: {:?}\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
    stdout
}

/// Runs `roam ARGS`, expecting exit `code` and one line on stderr that
/// contains `needle`; returns that line.
fn fails(state: &Path, args: &[&str], envs: &[(&str, &str)], code: i32, needle: &str) -> String {
    let out = roam(state, args, envs);
    // Progress lines and the note of a newly made secret are not part of
    // the error.
    let stderr = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| !l.contains("created the store secret") && !l.starts_with("roam: ["))
        .collect::<Vec<_>>()
        .join("\n");
    assert_eq!(
        out.status.code(),
        Some(code),
        "roam {args:?}: stderr: {stderr}"
    );
    assert!(
        stderr.contains(needle),
        "roam {args:?}: {stderr:?} lacks {needle:?}"
    );
    if code == 1 {
        assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    }
    stderr
}

/// The number after `label` in `text`, e.g. `uploaded` in "72 total, 2 uploaded".
fn number_before(text: &str, label: &str) -> u64 {
    let at = text
        .find(label)
        .unwrap_or_else(|| panic!("{label:?} not in {text}"));
    text[..at]
        .split_whitespace()
        .last()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number before {label:?} in {text}"))
}

/// The `N MB/s` figure of a summary.
fn mb_per_s(summary: &str) -> f64 {
    let at = summary.find(" MB/s").expect("MB/s in the summary");
    summary[..at]
        .split_whitespace()
        .last()
        .and_then(|n| n.parse().ok())
        .expect("a rate")
}

/// Chunk objects in a local store directory.
fn chunk_files(store: &Path) -> usize {
    let mut n = 0;
    for l1 in std::fs::read_dir(store.join("objects")).unwrap() {
        for l2 in std::fs::read_dir(l1.unwrap().path()).unwrap() {
            for leaf in std::fs::read_dir(l2.unwrap().path()).unwrap() {
                if leaf
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("chunks%")
                {
                    n += 1;
                }
            }
        }
    }
    n
}

/// Two images: an 8 MB "disk" and a 1 MB "memory", in `dir`.
struct Images {
    dir: PathBuf,
    disk: Vec<u8>,
    memory: Vec<u8>,
}

impl Images {
    fn new(dir: &Path, rng: &mut u64) -> Images {
        let images = Images {
            dir: dir.to_owned(),
            disk: random(rng, 8 << 20),
            memory: random(rng, 1 << 20),
        };
        images.write();
        images
    }

    fn write(&self) {
        std::fs::write(self.dir.join("disk"), &self.disk).unwrap();
        std::fs::write(self.dir.join("memory"), &self.memory).unwrap();
    }

    fn paths(&self) -> [String; 2] {
        ["disk", "memory"].map(|n| self.dir.join(n).display().to_string())
    }

    /// Rewrites chunks `a` and `b` of the disk.
    fn change_two_chunks(&mut self, rng: &mut u64, a: usize, b: usize) {
        for i in [a, b] {
            self.disk[i * CHUNK..(i + 1) * CHUNK].copy_from_slice(&random(rng, CHUNK));
        }
        self.write();
    }

    /// Checks that `dir` holds exactly these images.
    fn check(&self, dir: &Path, what: &str) {
        for (name, bytes) in [("disk", &self.disk), ("memory", &self.memory)] {
            let got = std::fs::read(dir.join(name)).unwrap();
            assert_eq!(got.len(), bytes.len(), "{what}: {name} length");
            assert_eq!(sha(&got), sha(bytes), "{what}: {name} sha256");
        }
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["disk", "memory"], "{what}: no temporary files left");
    }
}

/// Suspend, resume, change two chunks, suspend again (2 uploaded), resume
/// both versions, against the store `store_args` names. Returns the
/// (suspend, resume) MB/s of the first round.
fn round_trip(state: &Path, work: &Path, store_args: &[&str], envs: &[(&str, &str)]) -> (f64, f64) {
    let mut rng = seed();
    let mut images = Images::new(&work.join("in"), &mut {
        std::fs::create_dir(work.join("in")).unwrap();
        rng
    });
    rng = rng.wrapping_add(1);
    let [disk, memory] = images.paths();
    let with = |args: &[&str]| -> Vec<String> {
        args.iter()
            .chain(store_args)
            .map(|s| s.to_string())
            .collect()
    };
    let run = |args: Vec<String>| {
        ok(
            state,
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
            envs,
        )
    };

    let out = run(with(&["suspend", "--env", "laptop", &disk, &memory]));
    assert!(out.contains("suspended laptop version 1"), "{out}");
    assert_eq!(number_before(&out, "total,"), 72, "{out}");
    assert_eq!(number_before(&out, "uploaded,"), 72, "{out}");
    assert_eq!(number_before(&out, "already stored"), 0, "{out}");
    let suspend_rate = mb_per_s(&out);
    let v1 = work.join("v1");
    let out = run(with(&["resume", "--env", "laptop", v1.to_str().unwrap()]));
    assert!(out.contains("resumed laptop version 1"), "{out}");
    let resume_rate = mb_per_s(&out);
    images.check(&v1, "version 1");
    let (old_disk, old_memory) = (images.disk.clone(), images.memory.clone());

    images.change_two_chunks(&mut rng, 3, 40);
    let out = run(with(&["suspend", "--env", "laptop", &disk, &memory]));
    assert!(out.contains("suspended laptop version 2"), "{out}");
    assert_eq!(number_before(&out, "total,"), 72, "{out}");
    assert_eq!(number_before(&out, "uploaded,"), 2, "{out}");
    assert_eq!(number_before(&out, "already stored"), 70, "{out}");

    let v2 = work.join("v2");
    run(with(&["resume", "--env", "laptop", v2.to_str().unwrap()]));
    images.check(&v2, "version 2 (newest)");
    let v1_again = work.join("v1-again");
    run(with(&[
        "resume",
        "--env",
        "laptop",
        "--version",
        "1",
        v1_again.to_str().unwrap(),
    ]));
    let new = (images.disk.clone(), images.memory.clone());
    (images.disk, images.memory) = (old_disk, old_memory);
    images.check(&v1_again, "version 1 after version 2");
    (images.disk, images.memory) = new;
    let v2_again = work.join("v2-again");
    run(with(&[
        "resume",
        "--env",
        "laptop",
        "--version",
        "2",
        v2_again.to_str().unwrap(),
    ]));
    images.check(&v2_again, "version 2");

    let out = run(with(&["store", "list"]));
    for needle in [
        "laptop",
        "version 1: 9.4 MB in 72 chunks: disk 8.4 MB",
        "version 2: 9.4 MB in 72 chunks: disk 8.4 MB",
        "memory 1.0 MB (1048576 bytes)",
    ] {
        assert!(out.contains(needle), "{needle:?} in {out}");
    }
    (suspend_rate, resume_rate)
}

/// A resume's lookaside counts from its summary line `lookaside: A of B
/// chunks (X MB) taken locally, Y MB fetched: C bytes local, D chunks and
/// ... bytes fetched, E bytes of objects ...`: (A, B, C, D, E).
fn lookaside_counts(summary: &str) -> (u64, u64, u64, u64, u64) {
    let line = summary
        .lines()
        .find(|l| l.trim_start().starts_with("lookaside: ") && l.contains("taken locally"))
        .unwrap_or_else(|| panic!("no lookaside line in {summary}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    let n = |i: usize| -> u64 { words[i].parse().unwrap_or_else(|_| panic!("{line}")) };
    assert_eq!(words[2], "of", "{line}");
    (
        n(1),
        n(3),
        number_before(line, "bytes local"),
        number_before(line, "chunks and"),
        number_before(line, "bytes of objects"),
    )
}

/// `roam resume --lookaside` against the store `store_args` names: a fresh
/// copy (every chunk local), a stale one (the older version: only the 2
/// changed chunks fetched), a tampered one (its 2 altered chunks fetched),
/// a refresh in place (DIR its own lookaside, with --force), a missing
/// directory (one warning line, everything fetched). Every result is the
/// new version, checked by SHA-256 against the originals. Returns the
/// (fresh, stale) summaries.
fn lookaside_scenario(
    state: &Path,
    work: &Path,
    store_args: &[&str],
    envs: &[(&str, &str)],
) -> (String, String) {
    let mut rng = seed();
    std::fs::create_dir(work.join("in")).unwrap();
    let mut images = Images::new(&work.join("in"), &mut rng);
    let [disk, memory] = images.paths();
    let run = |args: &[&str]| -> String {
        let args: Vec<&str> = args.iter().chain(store_args).copied().collect();
        ok(state, &args, envs)
    };
    run(&["suspend", "--env", "lab", &disk, &memory]);
    // Version 1's files, as an older resumed copy would hold them.
    let old = work.join("old");
    std::fs::create_dir(&old).unwrap();
    images.dir = old.clone();
    images.write();
    images.dir = work.join("in");
    images.change_two_chunks(&mut rng, 3, 40);
    run(&["suspend", "--env", "lab", &disk, &memory]);
    let total = 72;
    let all_bytes = (images.disk.len() + images.memory.len()) as u64;
    let path = |p: &Path| p.to_str().unwrap().to_owned();

    // (a) fresh: the new version's own files.
    let fresh_dir = work.join("fresh");
    let fresh = run(&[
        "resume",
        "--env",
        "lab",
        "--lookaside",
        &path(&work.join("in")),
        &path(&fresh_dir),
    ]);
    images.check(&fresh_dir, "fresh lookaside");
    let (hits, chunks, local, fetched, object_bytes) = lookaside_counts(&fresh);
    assert_eq!((hits, chunks, fetched, object_bytes), (total, total, 0, 0));
    assert!(local * 10 >= all_bytes * 9, "≥ 90 % local: {fresh}");

    // (b) stale: version 1's files; only the 2 changed chunks fetched.
    let stale_dir = work.join("stale");
    let stale = run(&[
        "resume",
        "--env",
        "lab",
        "--lookaside",
        &path(&old),
        &path(&stale_dir),
    ]);
    images.check(&stale_dir, "stale lookaside");
    let (hits, _, local, fetched, object_bytes) = lookaside_counts(&stale);
    assert_eq!((hits, fetched), (total - 2, 2), "{stale}");
    assert_eq!(local, all_bytes - 2 * CHUNK as u64, "{stale}");
    assert!(object_bytes >= 2 * CHUNK as u64, "random chunks: {stale}");

    // (c) tampered: a fresh copy with 2 chunks altered; those come from
    // the store.
    let tampered = work.join("tampered");
    std::fs::create_dir(&tampered).unwrap();
    let mut bad = images.disk.clone();
    bad[7 * CHUNK + 1000] ^= 0x20;
    bad[50 * CHUNK] ^= 0x01;
    std::fs::write(tampered.join("disk"), &bad).unwrap();
    std::fs::write(tampered.join("memory"), &images.memory).unwrap();
    let tampered_out = work.join("from-tampered");
    let out = run(&[
        "resume",
        "--env",
        "lab",
        "--lookaside",
        &path(&tampered),
        &path(&tampered_out),
    ]);
    images.check(&tampered_out, "tampered lookaside");
    let (hits, _, _, fetched, _) = lookaside_counts(&out);
    assert_eq!((hits, fetched), (total - 2, 2), "{out}");

    // A refresh in place: version 1 resumed into DIR, then version 2 over
    // it with DIR as its own lookaside.
    let inplace = work.join("inplace");
    run(&["resume", "--env", "lab", "--version", "1", &path(&inplace)]);
    let out = run(&[
        "resume",
        "--env",
        "lab",
        "--force",
        "--lookaside",
        &path(&inplace),
        &path(&inplace),
    ]);
    images.check(&inplace, "refreshed in place");
    let (hits, _, _, fetched, _) = lookaside_counts(&out);
    assert_eq!((hits, fetched), (total - 2, 2), "{out}");

    // (d) a directory that does not exist: a warning naming it, one line;
    // the resume goes on from the other lookaside and the store.
    let missing = work.join("no-such-media");
    let missing_out = work.join("from-missing");
    let args: Vec<String> = [
        "resume",
        "--env",
        "lab",
        "--lookaside",
        &path(&missing),
        "--lookaside",
        &path(&old),
        &path(&missing_out),
    ]
    .iter()
    .chain(store_args)
    .map(|s| s.to_string())
    .collect();
    let out = roam(
        state,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        envs,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("roam: warning:"))
        .collect();
    assert_eq!(
        warnings,
        [format!(
            "roam: warning: lookaside {}: No such file or directory (os error 2) (not used; its \
             chunks come from the store)",
            missing.display()
        )],
        "{stderr}"
    );
    images.check(&missing_out, "a missing lookaside directory");
    let (hits, _, _, fetched, _) = lookaside_counts(&stdout);
    assert_eq!((hits, fetched), (total - 2, 2), "{stdout}");
    (fresh, stale)
}

#[test]
fn lookaside_fresh_stale_tampered_in_place_and_missing() {
    let state = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let (fresh, stale) = lookaside_scenario(state.path(), work.path(), &[], &[]);
    eprintln!("local store, fresh lookaside:\n{fresh}stale lookaside:\n{stale}");
    // Without --lookaside, no lookaside line.
    let plain = work.path().join("plain");
    let out = ok(
        state.path(),
        &["resume", "--env", "lab", plain.to_str().unwrap()],
        &[],
    );
    assert!(!out.contains("lookaside"), "{out}");
    // The store directory itself as lookaside: sealed objects never match;
    // a warning says what to do instead.
    let store = state.path().join("store");
    let from_store = work.path().join("from-store");
    let out = roam(
        state.path(),
        &[
            "resume",
            "--env",
            "lab",
            "--lookaside",
            store.to_str().unwrap(),
            from_store.to_str().unwrap(),
        ],
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "roam: warning: lookaside {} looks like a roam store",
            store.display()
        )),
        "{stderr}"
    );
    assert_eq!(lookaside_counts(&String::from_utf8_lossy(&out.stdout)).0, 0);
    let help = ok(state.path(), &["resume", "--help"], &[]);
    assert!(help.contains("--lookaside <DIR>"), "{help}");
    assert!(
        help.contains("roam resume --env laptop --lookaside"),
        "{help}"
    );
}

#[test]
fn local_store_round_trip_incremental_and_gc() {
    let state = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let (suspend, resume) = round_trip(state.path(), work.path(), &[], &[]);
    eprintln!("local store: suspend {suspend} MB/s, resume {resume} MB/s");

    // The secret was made on the first suspend, private.
    let secret = state.path().join("store.secret");
    let meta = std::fs::metadata(&secret).unwrap();
    assert_eq!(meta.len(), 32);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);

    // gc --keep 1: version 1's manifest goes, and the 2 chunks only it used.
    let store = state.path().join("store");
    let before = chunk_files(&store);
    assert_eq!(before, 74, "72 chunks of version 1 and the 2 new ones");
    let out = ok(
        state.path(),
        &["store", "gc", "--env", "laptop", "--keep", "1"],
        &[],
    );
    assert!(out.contains("deleted laptop version 1"), "{out}");
    assert_eq!(number_before(&out, "chunks no remaining"), 2, "{out}");
    assert_eq!(chunk_files(&store), before - 2);
    let out = ok(state.path(), &["store", "list"], &[]);
    assert!(
        !out.contains("version 1") && out.contains("version 2"),
        "{out}"
    );
    let after = work.path().join("after-gc");
    ok(
        state.path(),
        &["resume", "--env", "laptop", after.to_str().unwrap()],
        &[],
    );
    let v2 = std::fs::read(work.path().join("v2/disk")).unwrap();
    assert_eq!(sha(&std::fs::read(after.join("disk")).unwrap()), sha(&v2));
    fails(
        state.path(),
        &[
            "resume",
            "--env",
            "laptop",
            "--version",
            "1",
            after.to_str().unwrap(),
        ],
        &[],
        1,
        "environment laptop has no version 1",
    );
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn wrong_secret_existing_file_and_missing_env_are_precise_errors() {
    let state = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let s = state.path();
    let image = work.path().join("memory");
    std::fs::write(&image, random(&mut seed(), 300_000)).unwrap();
    let out = roam(s, &["suspend", "--env", "vm", image.to_str().unwrap()], &[]);
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("created the store secret") && stderr.contains("losing it loses the data"),
        "{stderr}"
    );
    let out = roam(s, &["suspend", "--env", "vm", image.to_str().unwrap()], &[]);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("created the store secret"));

    // Another secret: refused with the manifest named.
    let other = work.path().join("other.secret");
    std::fs::write(&other, [7u8; 32]).unwrap();
    let dest = work.path().join("out");
    let dest_s = dest.to_str().unwrap();
    let line = fails(
        s,
        &[
            "resume",
            "--env",
            "vm",
            "--secret",
            other.to_str().unwrap(),
            dest_s,
        ],
        &[],
        1,
        "the store's manifest for vm v2 was not sealed with this secret",
    );
    assert!(line.contains("other.secret"), "{line}");
    assert!(!dest.join("memory").exists());

    // An existing file of an image's name: refused, untouched; --force writes.
    std::fs::create_dir(&dest).unwrap();
    std::fs::write(dest.join("memory"), b"mine").unwrap();
    fails(
        s,
        &["resume", "--env", "vm", dest_s],
        &[],
        1,
        "exists: resume would overwrite",
    );
    assert_eq!(std::fs::read(dest.join("memory")).unwrap(), b"mine");
    ok(s, &["resume", "--env", "vm", "--force", dest_s], &[]);
    assert_eq!(
        sha(&std::fs::read(dest.join("memory")).unwrap()),
        sha(&std::fs::read(&image).unwrap())
    );

    // No such environment or version; no secret; no store; bad arguments.
    fails(
        s,
        &["resume", "--env", "nosuch", dest_s],
        &[],
        1,
        "no environment nosuch in the store",
    );
    fails(
        s,
        &["resume", "--env", "vm", "--version", "9", dest_s],
        &[],
        1,
        "environment vm has no version 9",
    );
    let store = s.join("store");
    let fresh = tempfile::tempdir().unwrap();
    fails(
        fresh.path(),
        &[
            "resume",
            "--env",
            "vm",
            "--store",
            store.to_str().unwrap(),
            dest_s,
        ],
        &[],
        1,
        "no store secret at",
    );
    fails(
        s,
        &["store", "list", "--store", "/nonexistent/roam-store"],
        &[],
        1,
        "no store at /nonexistent/roam-store",
    );
    fails(
        s,
        &["suspend", "--env", "vm", "/nonexistent/disk.img"],
        &[],
        1,
        "cannot read /nonexistent/disk.img",
    );
    let twin = work.path().join("twin");
    std::fs::create_dir(&twin).unwrap();
    std::fs::write(twin.join("memory"), b"x").unwrap();
    fails(
        s,
        &[
            "suspend",
            "--env",
            "vm",
            image.to_str().unwrap(),
            twin.join("memory").to_str().unwrap(),
        ],
        &[],
        2,
        "would both be image \"memory\"",
    );
    fails(
        s,
        &["suspend", "--env", "a/b", image.to_str().unwrap()],
        &[],
        2,
        "",
    );
    fails(
        s,
        &[
            "suspend",
            "--env",
            "vm",
            "--store",
            "s3://bucket",
            image.to_str().unwrap(),
        ],
        &[],
        2,
        "needs an endpoint",
    );
}

#[test]
fn unreachable_s3_endpoint_is_named() {
    let state = tempfile::tempdir().unwrap();
    // A port nobody listens on (bound, then released).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let image = state.path().join("img");
    std::fs::write(&image, b"data").unwrap();
    let started = Instant::now();
    fails(
        state.path(),
        &[
            "suspend",
            "--env",
            "vm",
            "--store",
            "s3://roam",
            "--s3-endpoint",
            &endpoint,
            image.to_str().unwrap(),
        ],
        &[("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s")],
        1,
        &format!("s3://roam at {endpoint}"),
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

mod s3 {
    use super::*;
    use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
    use std::process::{Child, Stdio};

    /// A real S3 server (s3s-fs) on a free 127.0.0.1 port, killed when dropped.
    struct S3Server {
        child: Child,
        /// Its data directory (buckets are directories in it).
        _root: tempfile::TempDir,
        addr: SocketAddr,
    }

    const ACCESS_KEY: &str = "roam-test";
    const SECRET_KEY: &str = "roam-test-secret-key";
    const BUCKET: &str = "roam";

    impl S3Server {
        /// Starts `$ROAM_S3S_FS`, or says why the S3 test cannot run.
        fn start() -> Result<S3Server, String> {
            let Some(bin) = std::env::var_os("ROAM_S3S_FS").filter(|v| !v.is_empty()) else {
                return Err(
                    "ROAM_S3S_FS is not set (ROAM_S3S_FS=$(scripts/s3s-build) runs this test)"
                        .into(),
                );
            };
            // From here on the variable is set: failing to start is a failure.
            let root = tempfile::tempdir().unwrap();
            std::fs::create_dir(root.path().join(BUCKET)).unwrap();
            for _attempt in 0..5 {
                let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
                    .and_then(|l| l.local_addr())
                    .unwrap()
                    .port();
                let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
                let mut child = Command::new(&bin)
                    .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                    .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
                    .arg(root.path())
                    .stdout(Stdio::null())
                    .stderr(Stdio::inherit())
                    .spawn()
                    .unwrap_or_else(|e| panic!("ROAM_S3S_FS={bin:?} does not start: {e}"));
                let deadline = Instant::now() + Duration::from_secs(10);
                loop {
                    if TcpStream::connect(addr).is_ok() {
                        return Ok(S3Server {
                            child,
                            _root: root,
                            addr,
                        });
                    }
                    if child.try_wait().unwrap().is_some() || Instant::now() > deadline {
                        let _ = child.kill();
                        let _ = child.wait();
                        break; // the port was taken meanwhile: try another
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            panic!("ROAM_S3S_FS={bin:?} did not start listening");
        }
    }

    impl Drop for S3Server {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    #[test]
    fn s3_store_round_trip_incremental() {
        let server = match S3Server::start() {
            Ok(s) => s,
            Err(why) => {
                eprintln!("skipping: {why}");
                return;
            }
        };
        let state = tempfile::tempdir().unwrap();
        let work = tempfile::tempdir().unwrap();
        let endpoint = format!("http://{}", server.addr);
        let store = format!("s3://{BUCKET}");
        let (suspend, resume) = round_trip(
            state.path(),
            work.path(),
            &["--store", &store],
            &[
                ("ROAM_S3_ENDPOINT", &endpoint),
                ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
                ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ],
        );
        eprintln!("S3 store (s3s-fs): suspend {suspend} MB/s, resume {resume} MB/s");
        // Nothing was written to the local default store.
        assert!(!state.path().join("store").exists());
    }

    #[test]
    fn s3_store_lookaside() {
        let server = match S3Server::start() {
            Ok(s) => s,
            Err(why) => {
                eprintln!("skipping: {why}");
                return;
            }
        };
        let state = tempfile::tempdir().unwrap();
        let work = tempfile::tempdir().unwrap();
        let endpoint = format!("http://{}", server.addr);
        let store = format!("s3://{BUCKET}");
        let (fresh, stale) = lookaside_scenario(
            state.path(),
            work.path(),
            &["--store", &store],
            &[
                ("ROAM_S3_ENDPOINT", &endpoint),
                ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
                ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ],
        );
        eprintln!("S3 store (s3s-fs), fresh lookaside:\n{fresh}stale lookaside:\n{stale}");
    }
}

#[test]
fn help_teaches_with_examples() {
    for sub in [
        &["suspend", "--help"][..],
        &["resume", "--help"],
        &["store", "--help"],
        &["store", "list", "--help"],
        &["store", "gc", "--help"],
    ] {
        let out = Command::new(BIN).args(sub).output().unwrap();
        assert!(out.status.success(), "{sub:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("Examples:"), "{sub:?}: {text}");
    }
}

#[test]
fn config_file_names_the_store_and_secret() {
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    let store = s.join("elsewhere");
    let secret = s.join("my.secret");
    let config = s.join("config.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\nlocation = {:?}\nsecret = {:?}\n",
            store.display().to_string(),
            secret.display().to_string()
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let image = s.join("img");
    std::fs::write(&image, b"hello").unwrap();
    ok(
        s,
        &[
            "--config",
            config,
            "suspend",
            "--env",
            "cfg",
            image.to_str().unwrap(),
        ],
        &[],
    );
    assert!(store.join("objects").is_dir() && !s.join("store").exists());
    assert_eq!(std::fs::metadata(&secret).unwrap().len(), 32);
    let out = ok(s, &["--config", config, "store", "list"], &[]);
    assert!(
        out.contains("cfg") && out.contains("img 0.0 MB (5 bytes)"),
        "{out}"
    );
}

/// A tmpfs mounted for one test, unmounted (lazily) when dropped, even if
/// the test failed.
struct Tmpfs {
    /// The mount point (inside `_dir`).
    path: PathBuf,
    /// Holds the mount point's parent until after the unmount.
    _dir: tempfile::TempDir,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (mount's syntax, e.g. `1m`), or says why not.
    fn mount(size: &str) -> Result<Tmpfs, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let path = dir.path().join("mnt");
        std::fs::create_dir(&path).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&path)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs failed (not root?): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Tmpfs { path, _dir: dir })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

#[test]
fn full_disk_on_resume_is_named_and_leaves_no_partial_image() {
    let fs = match Tmpfs::mount("1m") {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("skipping: {why}");
            return;
        }
    };
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    let mut rng = seed() ^ 3;
    let (small, big) = (s.join("small"), s.join("big"));
    std::fs::write(&small, random(&mut rng, 300_000)).unwrap();
    std::fs::write(&big, random(&mut rng, 3_000_000)).unwrap();
    ok(
        s,
        &[
            "suspend",
            "--env",
            "vm",
            small.to_str().unwrap(),
            big.to_str().unwrap(),
        ],
        &[],
    );
    let line = fails(
        s,
        &["resume", "--env", "vm", fs.path.to_str().unwrap()],
        &[],
        1,
        "writing image big",
    );
    assert!(line.contains("the disk is full"), "{line}");
    // The image written before is whole; the one that failed left nothing.
    let names: Vec<String> = std::fs::read_dir(&fs.path)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["small"]);
    assert_eq!(
        sha(&std::fs::read(fs.path.join("small")).unwrap()),
        sha(&std::fs::read(&small).unwrap())
    );
}
