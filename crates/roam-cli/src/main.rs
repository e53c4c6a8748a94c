//! `roam`: keep TCP sessions (ssh and friends) alive across Wi-Fi drops,
//! sleep and address changes. See `roam --help`; the logic lives in the
//! `roam_cli` library.

#![forbid(unsafe_code)]

fn main() {
    std::process::exit(roam_cli::main());
}
