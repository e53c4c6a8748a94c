//! The scenarios. Each returns its typed result or an error; `main`
//! turns that into the scenario's status in the report.

use serde::Serialize;

pub(crate) mod cluster;
pub(crate) mod interpose;
pub(crate) mod isr;
pub(crate) mod latency;
pub(crate) mod many;
pub(crate) mod memory;
pub(crate) mod migrate;
pub(crate) mod resume;
pub(crate) mod service;
pub(crate) mod setup;
pub(crate) mod shell;
pub(crate) mod takeover;
pub(crate) mod throughput;

use crate::peers::{ROAM_FORWARD, ROAM_PIPE, ROAM_PIPE_NAMED, ROAM_SESSION};

/// The roam peers whose ratios the report shows.
pub(crate) const ROAM_PEERS: &[&str] = &[ROAM_FORWARD, ROAM_PIPE, ROAM_PIPE_NAMED, ROAM_SESSION];

/// One ratio of medians measured in the same run.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RatioRow {
    pub(crate) case: String,
    pub(crate) roam: String,
    pub(crate) versus: String,
    pub(crate) ratio: f64,
}

/// Ratios `get(roam) / get(other)` for every roam peer and other peer.
pub(crate) fn ratio_rows(
    case: &str,
    roams: &[&str],
    others: &[&str],
    get: impl Fn(&str) -> f64,
) -> Vec<RatioRow> {
    let mut v = Vec::new();
    for r in roams {
        for o in others {
            v.push(RatioRow {
                case: case.to_string(),
                roam: r.to_string(),
                versus: o.to_string(),
                ratio: crate::stats::ratio(get(r), get(o)),
            });
        }
    }
    v
}

/// A progress line on stderr, with the time since the run started.
pub(crate) fn progress(msg: &str) {
    eprintln!("[{:7.1}s] {msg}", crate::started().elapsed().as_secs_f64());
}
