//! Builds `roam run`'s preload library (crates/roam-preload, a cdylib) and
//! hands its path to the `roam` binary, which embeds it: one self-contained
//! binary, and no build step outside `cargo build`/`cargo test` (cargo does
//! not build a cdylib member for another crate's tests).
//!
//! The library is built by a nested cargo into this build's own output
//! directory (its own target directory: no lock shared with the outer
//! build), always optimised, with none of the outer build's compiler flags
//! or wrappers (a fuzzing or clippy build must not leak into a library that
//! is loaded into other programs).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("manifest dir"));
    let preload = manifest.join("../roam-preload");
    println!("cargo:rerun-if-changed={}", preload.join("src").display());
    println!(
        "cargo:rerun-if-changed={}",
        preload.join("Cargo.toml").display()
    );
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let target_dir = out.join("preload");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.arg("build")
        .arg("--release")
        .arg("--manifest-path")
        .arg(preload.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir);
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "RUSTDOCFLAGS",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_BUILD_RUSTC_WRAPPER",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_MAKEFLAGS",
        "CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS",
        "CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS",
    ] {
        cmd.env_remove(var);
    }
    // No debug information: the library is embedded in `roam` and loaded
    // into every program `roam run` starts.
    cmd.env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .env("CARGO_PROFILE_RELEASE_STRIP", "debuginfo");
    let status = cmd.status().expect("run cargo for roam-preload");
    assert!(status.success(), "building roam-preload failed: {status}");
    let lib = target_dir.join("release/libroam_preload.so");
    assert!(lib.exists(), "no {}", lib.display());
    println!("cargo:rustc-env=ROAM_PRELOAD_SO={}", lib.display());
}
