//! The `roam` command as a library: argument definitions, the relay, the
//! client commands and their files. `src/main.rs` is a thin wrapper around
//! [`main`]; the [`parsers`] module exposes the text and byte decoders for the
//! fuzz targets in `fuzz/`.

#![forbid(unsafe_code)]

mod cli;
mod cluster;
mod config;
mod connect;
mod control;
mod demo;
mod forward;
mod keys;
mod limits;
mod metrics;
mod named;
mod notices;
mod paths;
mod pipe;
mod pump;
mod sdnotify;
mod serve;
mod shell;
mod signals;
mod stdio;
mod takeover;
mod target;

pub mod parsers;

/// Runs the `roam` command with the process's arguments; returns its exit code.
pub fn main() -> i32 {
    use clap::Parser;
    let args = cli::Cli::parse();
    cli::init_logging(&args);
    cli::run(args)
}
