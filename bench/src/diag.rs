//! Evidence printed when a scenario fails, before the scratch directory
//! (and with it every peer's log) is removed: the relay's warnings and the
//! `ended: <error>` lines behind its stream resets, the target agent's
//! log, open descriptors of the long-lived processes, and the kernel's
//! socket summary. Kept to a few dozen lines so a CI log explains itself.

use std::collections::BTreeMap;
use std::path::Path;

use crate::peers::{Env, Lab};
use crate::scenarios::progress;

/// Lines of each log shown at most.
const TAIL: usize = 12;

/// Kernel counters (`/proc/net/netstat`, `/proc/net/snmp`; machine-wide)
/// whose growth during a failed scenario is shown: listen-queue overflows,
/// SYN cookies, resets, memory pressure.
const COUNTERS: &[&str] = &[
    "TcpExt:ListenOverflows",
    "TcpExt:ListenDrops",
    "TcpExt:TCPReqQFullDoCookies",
    "TcpExt:TCPReqQFullDrop",
    "TcpExt:SyncookiesSent",
    "TcpExt:SyncookiesRecv",
    "TcpExt:SyncookiesFailed",
    "TcpExt:TCPAbortOnData",
    "TcpExt:TCPAbortOnMemory",
    "TcpExt:TCPMemoryPressures",
    "Tcp:EstabResets",
    "Tcp:OutRsts",
];

/// Prints the evidence of a failed scenario (as progress lines); `net0`:
/// [`crate::procs::net_counters`] when the scenario started.
pub(crate) fn report(env: &Env, lab: &Lab, net0: &BTreeMap<String, u64>) {
    for line in evidence(env, lab, net0) {
        progress(&format!("  | {line}"));
    }
}

fn evidence(env: &Env, lab: &Lab, net0: &BTreeMap<String, u64>) -> Vec<String> {
    let mut out = Vec::new();
    let net = crate::procs::net_counters();
    let grew: Vec<String> = COUNTERS
        .iter()
        .filter_map(|k| {
            let d = net.get(*k)?.saturating_sub(*net0.get(*k)?);
            (d > 0).then(|| format!("{} +{d}", k.split_once(':').map_or(*k, |x| x.1)))
        })
        .collect();
    out.push(format!(
        "kernel TCP counters during the scenario (whole machine): {}",
        if grew.is_empty() {
            "none of note grew".to_string()
        } else {
            grew.join(", ")
        }
    ));
    let fds = [
        ("roam serve", lab.serve.proc.pid()),
        ("roam forward", lab.forward.proc.pid()),
        ("targets", lab.targets.pid()),
        ("roam-bench", std::process::id()),
    ]
    .iter()
    .map(|(name, pid)| format!("{name} {}", open_fds(*pid)))
    .collect::<Vec<_>>()
    .join(", ");
    out.push(format!("open descriptors: {fds}"));
    if let Ok(o) = std::process::Command::new("ss").arg("-s").output() {
        let text = String::from_utf8_lossy(&o.stdout);
        for l in text.lines().filter(|l| {
            let t = l.trim_start();
            t.starts_with("Total") || t.starts_with("TCP:")
        }) {
            out.push(format!("ss -s: {}", l.trim()));
        }
    }
    // The relay logs at info: keep what explains a failure (warnings,
    // errors, streams that ended with an error), not every stream opened.
    interesting(&env.log("roam-serve"), "roam serve", &mut out, |l| {
        l.contains("WARN") || l.contains("ERROR") || l.contains(" ended: ")
    });
    interesting(&env.log("roam-forward"), "roam forward", &mut out, |l| {
        l.contains("WARN") || l.contains("ERROR") || l.contains("ended")
    });
    interesting(&env.log("agents"), "agents", &mut out, |_| true);
    out
}

/// The last [`TAIL`] lines of `path` that `keep` selects, with how many it
/// selected in all.
fn interesting(path: &Path, name: &str, out: &mut Vec<String>, keep: impl Fn(&str) -> bool) {
    let Ok(bytes) = std::fs::read(path) else {
        out.push(format!("{name}: no log at {}", path.display()));
        return;
    };
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<&str> = text.lines().filter(|l| keep(l)).collect();
    out.push(format!(
        "{name} log ({}): {} relevant lines{}",
        path.display(),
        lines.len(),
        if lines.len() > TAIL {
            format!(", the last {TAIL}:")
        } else {
            String::new()
        }
    ));
    for l in &lines[lines.len().saturating_sub(TAIL)..] {
        out.push(format!("  {}", shorten(l)));
    }
}

/// A log line without its ANSI colours, cut at 300 characters.
fn shorten(l: &str) -> String {
    let mut s = String::with_capacity(l.len());
    let mut esc = false;
    for c in l.chars() {
        match (esc, c) {
            (false, '\u{1b}') => esc = true,
            (true, 'm') => esc = false,
            (true, _) => {}
            (false, c) => s.push(c),
        }
    }
    if s.chars().count() > 300 {
        s = s.chars().take(300).collect::<String>() + "…";
    }
    s
}

/// Open descriptors of `pid`, or `?`.
fn open_fds(pid: u32) -> String {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map_or_else(|_| "?".into(), |d| d.count().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shorten_strips_colours_and_cuts() {
        assert_eq!(shorten("\u{1b}[33mWARN\u{1b}[0m x"), "WARN x");
        assert_eq!(shorten(&"a".repeat(400)).chars().count(), 301);
    }

    #[test]
    fn own_descriptors_are_counted() {
        assert_ne!(open_fds(std::process::id()), "?");
    }
}
