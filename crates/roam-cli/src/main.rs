//! `roam`: keep TCP sessions (ssh and friends) alive across Wi-Fi drops,
//! sleep and address changes. See `roam --help`; logic lives in the modules.

#![forbid(unsafe_code)]

mod cli;
mod config;
mod connect;
mod control;
mod demo;
mod forward;
mod keys;
mod paths;
mod pipe;
mod serve;
mod target;

use clap::Parser;

fn main() {
    let args = cli::Cli::parse();
    cli::init_logging(&args);
    let code = cli::run(args);
    std::process::exit(code);
}
