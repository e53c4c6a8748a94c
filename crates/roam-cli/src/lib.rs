//! The `roam` command as a library: argument definitions, the relay, the
//! client commands and their files. `src/main.rs` is a thin wrapper around
//! [`main`]; the [`parsers`] module exposes the text and byte decoders for the
//! fuzz targets in `fuzz/`.

#![forbid(unsafe_code)]

/// `eprintln!` in one write(2). `eprintln!` writes a line in pieces (one
/// write per literal and argument), and a relay shares its stderr with the
/// successor SIGUSR2 starts, so the two processes' lines interleaved
/// mid-line ("took over roam serve: handed 1 sessions ..."). A line written
/// whole (shorter than `PIPE_BUF`) reaches a pipe or the journal in one
/// piece. A failed write is ignored where `eprintln!` would panic.
macro_rules! eprintln_whole {
    ($($arg:tt)*) => {
        $crate::write_stderr_line(::std::format_args!($($arg)*))
    };
}

mod cli;
mod cluster;
mod config;
mod connect;
mod control;
mod demand;
mod demo;
mod forward;
mod intercept;
mod keys;
mod limits;
mod metrics;
mod migrate;
mod named;
mod notices;
mod paths;
mod pipe;
mod pump;
mod run;
mod sdnotify;
mod serve;
mod shell;
mod signals;
mod stdio;
mod store;
mod store_remote;
mod takeover;
mod target;
mod vm;

pub mod parsers;

/// Writes `args` and a newline to stderr in one write (`eprintln_whole!`).
pub(crate) fn write_stderr_line(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut line = args.to_string();
    line.push('\n');
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// Runs the `roam` command with the process's arguments; returns its exit code.
pub fn main() -> i32 {
    use clap::Parser;
    let args = cli::Cli::parse();
    cli::init_logging(&args);
    cli::run(args)
}
