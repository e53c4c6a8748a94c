//! A normal build cannot enable the fuzzing stand-ins (`src/suite_fuzzing.rs`).
//!
//! They are compiled only under `cfg(fuzzing)`, which cargo-fuzz passes in
//! `RUSTFLAGS`; no Cargo feature, build script or dependency of roam-proto can
//! set it. These tests pin that down: the flag is off, the crate offers no
//! switch for it, and the primitives a normal build uses are the real ones
//! (X25519 and AES-256-GCM known answers through the crate's own code paths).

use roam_proto::{Keypair, PublicKey};

#[cfg(fuzzing)]
compile_error!("the roam-proto tests must not be built with --cfg fuzzing");

#[test]
fn normal_build_is_not_fuzzing_mode() {
    assert!(!roam_proto::fuzzing_mode());
}

#[test]
fn crate_has_no_switch_for_fuzzing_mode() {
    let dir = env!("CARGO_MANIFEST_DIR");
    assert!(
        !std::path::Path::new(dir).join("build.rs").exists(),
        "a build script could set cfg(fuzzing)"
    );
    let manifest = std::fs::read_to_string(format!("{dir}/Cargo.toml")).unwrap();
    assert!(
        !manifest.contains("[features]"),
        "roam-proto grew Cargo features; make sure none can turn on the stand-ins"
    );
    assert!(!manifest.contains("build ="), "no build script");
}

#[test]
fn public_keys_are_real_x25519() {
    // RFC 7748 §6.1, Alice.
    let private: [u8; 32] =
        hex::decode("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
            .unwrap()
            .try_into()
            .unwrap();
    let expected: PublicKey = "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a"
        .parse()
        .unwrap();
    assert_eq!(Keypair::from_private(private).public(), expected);
}
