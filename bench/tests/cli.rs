//! The `roam-bench` command line as a user meets it: what `--help` teaches
//! and the errors a mistyped scenario or case gets, before anything runs.
//! (This test also makes `cargo test` build the `roam-bench` binary with the
//! suite's own features, which CI's benchmark smoke then runs: `bench/run
//! --no-build`.)

use std::process::Command;

/// Every scenario `--only` accepts, in the order the suite runs them.
const SCENARIOS: [&str; 13] = [
    "throughput",
    "latency",
    "setup",
    "resume",
    "memory",
    "many",
    "cluster",
    "takeover",
    "shell",
    "migrate",
    "interpose",
    "service",
    "isr",
];

/// `roam-bench ARGS` with its output directory in a fresh temporary one.
fn bench(args: &[&str]) -> (std::process::Output, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let out = Command::new(env!("CARGO_BIN_EXE_roam-bench"))
        .args(args)
        .arg("--out")
        .arg(dir.path().join("out"))
        .output()
        .expect("run roam-bench");
    (out, dir)
}

#[test]
fn help_names_every_scenario_and_mode() {
    let (out, _dir) = bench(&["--help"]);
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8_lossy(&out.stdout);
    for word in SCENARIOS
        .iter()
        .chain(&["--quick", "--full", "--self-check", "--only", "--roam"])
    {
        assert!(
            help.contains(word),
            "--help does not mention {word}:\n{help}"
        );
    }
}

#[test]
fn an_unknown_scenario_is_refused_by_name_before_anything_runs() {
    let (out, dir) = bench(&["--self-check", "--only", "latency,thruput"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown scenario \"thruput\""), "{err}");
    let choices = format!("choose from {}", SCENARIOS.join(", "));
    assert!(err.contains(&choices), "{err}");
    assert!(
        !dir.path().join("out").exists(),
        "a refused run wrote results"
    );
}

#[test]
fn malformed_cases_say_what_was_expected() {
    for (flag, value, expected) in [
        (
            "--isr-links",
            "100",
            "100: expected MBITxROUNDS, e.g. 100x3",
        ),
        ("--migrate-cases", "1000by10", "expected CONNECTIONSxMB"),
        (
            "--migrate-movers",
            "scp",
            "scp: expected one of criu, roam, no-reinject, lazy",
        ),
    ] {
        let (out, dir) = bench(&[flag, value]);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{flag} {value}: {err}");
        assert!(
            !dir.path().join("out").exists(),
            "{flag} {value} wrote results"
        );
    }
}
