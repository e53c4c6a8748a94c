//! `roam`: keep TCP sessions (ssh and friends) alive across Wi-Fi drops,
//! sleep and address changes. See `roam --help`; the logic lives in the
//! `roam_cli` library.

#![forbid(unsafe_code)]

/// jemalloc (feature `jemalloc`, on by default) gives the pages of freed
/// memory back: a relay's parked sessions cost what they hold, not what the
/// heap once held. Configured at build time in `.cargo/config.toml`.
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    std::process::exit(roam_cli::main());
}
