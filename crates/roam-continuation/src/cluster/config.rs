//! The cluster file: which hosts serve one service together, where clients
//! and peers reach each, and each host's key (`docs/PROTOCOL.md` §14.1).
//!
//! ```text
//! # cluster.conf — the same file on every host
//! cluster files-eu
//! host a  clients=10.0.0.1:7447  peers=10.0.0.1:7547  key=3f1c…(64 hex digits)
//! host b  clients=10.0.0.2:7447  peers=10.0.0.2:7547  key=9a0e…
//! operator alice  key=77d2…
//! ```
//!
//! Lines are `#` comments, blank, or one of the three kinds above; fields
//! after the name are `name=value`, in any order. A host's `key` is the
//! public half of its *host key* (not the service key clients pin): hosts
//! authenticate each other with it. An `operator` key may send the operator
//! requests (`roam cluster status/move/drain`) but never takes sessions.

use std::collections::BTreeMap;
use std::fmt;

use roam_proto::PublicKey;

/// Longest cluster or host name.
pub const MAX_NAME_LEN: usize = 64;

/// One host of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Its name (unique in the file).
    pub name: String,
    /// `host:port` where clients reach its roam server.
    pub clients: String,
    /// `host:port` where other hosts reach its cluster port.
    pub peers: String,
    /// Its host key.
    pub key: PublicKey,
}

/// A parsed cluster file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// The cluster's name: bound into every host-to-host handshake, so two
    /// clusters that share a key by mistake still cannot talk.
    pub name: String,
    /// Its hosts, by name.
    pub hosts: BTreeMap<String, Member>,
    /// Operators' keys, by name.
    pub operators: BTreeMap<String, PublicKey>,
}

/// A cluster file that could not be parsed: the line and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// 1-based line number (0: the file as a whole).
    pub line: usize,
    /// What is wrong.
    pub what: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "cluster file: {}", self.what)
        } else {
            write!(f, "cluster file line {}: {}", self.line, self.what)
        }
    }
}

impl std::error::Error for ConfigError {}

fn err(line: usize, what: impl Into<String>) -> ConfigError {
    ConfigError {
        line,
        what: what.into(),
    }
}

fn check_name(line: usize, kind: &str, n: &str) -> Result<(), ConfigError> {
    if n.is_empty()
        || n.len() > MAX_NAME_LEN
        || !n
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(err(
            line,
            format!("{kind} name {n:?} must be 1-{MAX_NAME_LEN} letters, digits, '-', '_' or '.'"),
        ));
    }
    Ok(())
}

impl ClusterConfig {
    /// Parses a cluster file's text.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let mut name = None;
        let mut hosts = BTreeMap::new();
        let mut operators = BTreeMap::new();
        let mut keys_seen = BTreeMap::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let l = raw.split('#').next().unwrap_or("").trim();
            if l.is_empty() {
                continue;
            }
            let mut words = l.split_whitespace();
            let kind = words.next().unwrap_or("");
            match kind {
                "cluster" => {
                    let n = words
                        .next()
                        .ok_or_else(|| err(line, "`cluster` needs a name"))?;
                    check_name(line, "cluster", n)?;
                    if words.next().is_some() {
                        return Err(err(line, "`cluster NAME` takes nothing else"));
                    }
                    if name.replace(n.to_string()).is_some() {
                        return Err(err(line, "a second `cluster` line"));
                    }
                }
                "host" | "operator" => {
                    let n = words
                        .next()
                        .ok_or_else(|| err(line, format!("`{kind}` needs a name")))?;
                    check_name(line, kind, n)?;
                    let mut fields = BTreeMap::new();
                    for w in words {
                        let (k, v) = w
                            .split_once('=')
                            .ok_or_else(|| err(line, format!("expected name=value, got {w:?}")))?;
                        let allowed: &[&str] = if kind == "host" {
                            &["clients", "peers", "key"]
                        } else {
                            &["key"]
                        };
                        if !allowed.contains(&k) {
                            return Err(err(
                                line,
                                format!(
                                    "unknown field {k:?} for {kind} (expected {})",
                                    allowed.join(", ")
                                ),
                            ));
                        }
                        if v.is_empty() || v.len() > 1024 {
                            return Err(err(line, format!("field {k} is empty or too long")));
                        }
                        if fields.insert(k, v).is_some() {
                            return Err(err(line, format!("field {k} given twice")));
                        }
                    }
                    let key_text = fields
                        .get("key")
                        .ok_or_else(|| err(line, format!("{kind} {n} has no key=")))?;
                    let key: PublicKey = key_text
                        .parse()
                        .map_err(|e| err(line, format!("key of {n}: {e}")))?;
                    if let Some(other) = keys_seen.insert(key, n.to_string()) {
                        return Err(err(line, format!("{n} has the same key as {other}")));
                    }
                    if kind == "host" {
                        let get = |f: &str| {
                            fields
                                .get(f)
                                .map(|s| s.to_string())
                                .ok_or_else(|| err(line, format!("host {n} has no {f}=")))
                        };
                        let m = Member {
                            name: n.to_string(),
                            clients: get("clients")?,
                            peers: get("peers")?,
                            key,
                        };
                        if hosts.insert(n.to_string(), m).is_some() {
                            return Err(err(line, format!("host {n} listed twice")));
                        }
                    } else if operators.insert(n.to_string(), key).is_some() {
                        return Err(err(line, format!("operator {n} listed twice")));
                    }
                    if hosts.contains_key(n) && operators.contains_key(n) {
                        return Err(err(line, format!("{n} is both a host and an operator")));
                    }
                }
                other => {
                    return Err(err(
                        line,
                        format!("unknown line kind {other:?} (expected cluster, host or operator)"),
                    ))
                }
            }
        }
        let name = name.ok_or_else(|| err(0, "no `cluster NAME` line"))?;
        if hosts.is_empty() {
            return Err(err(0, "no `host` lines"));
        }
        Ok(Self {
            name,
            hosts,
            operators,
        })
    }

    /// The file's text for these hosts and operators (parses back to `self`).
    pub fn to_text(&self) -> String {
        let mut s = format!("cluster {}\n", self.name);
        for m in self.hosts.values() {
            s.push_str(&format!(
                "host {} clients={} peers={} key={}\n",
                m.name, m.clients, m.peers, m.key
            ));
        }
        for (n, k) in &self.operators {
            s.push_str(&format!("operator {n} key={k}\n"));
        }
        s
    }

    /// The host whose host key is `key`.
    pub fn host_by_key(&self, key: &PublicKey) -> Option<&Member> {
        self.hosts.values().find(|m| m.key == *key)
    }

    /// The operator whose key is `key`.
    pub fn operator_by_key(&self, key: &PublicKey) -> Option<&str> {
        self.operators
            .iter()
            .find(|(_, k)| *k == key)
            .map(|(n, _)| n.as_str())
    }
}

/// Fuzzing only (the `cluster` fuzz target): parsing never panics, and a
/// parsed file's text parses back to the same configuration.
#[cfg(fuzzing)]
pub fn fuzz_round_trip(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(c) = ClusterConfig::parse(text) {
            let again = ClusterConfig::parse(&c.to_text()).expect("to_text parses");
            assert_eq!(again, c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K1: &str = "0101010101010101010101010101010101010101010101010101010101010101";
    const K2: &str = "0202020202020202020202020202020202020202020202020202020202020202";
    const K3: &str = "0303030303030303030303030303030303030303030303030303030303030303";

    #[test]
    fn a_good_file_parses_and_round_trips() {
        let text = format!(
            "# two hosts\ncluster files-eu\n\nhost a clients=127.0.0.1:1 peers=127.0.0.1:2 key={K1}\n\
             host b  key={K2} peers=127.0.0.1:4 clients=127.0.0.1:3  # comment\noperator alice key={K3}\n"
        );
        let c = ClusterConfig::parse(&text).unwrap();
        assert_eq!(c.name, "files-eu");
        assert_eq!(c.hosts["b"].clients, "127.0.0.1:3");
        assert_eq!(c.operator_by_key(&K3.parse().unwrap()), Some("alice"));
        assert_eq!(ClusterConfig::parse(&c.to_text()).unwrap(), c);
    }

    #[test]
    fn mistakes_name_the_line_and_the_problem() {
        let cases = [
            ("host a clients=x peers=y key=zz\ncluster c", 1, "key of a"),
            (&format!("cluster c\nhost a clients=x key={K1}"), 2, "no peers="),
            (&format!("cluster c\nhost a clients=x peers=y port=1 key={K1}"), 2, "unknown field"),
            (&format!("cluster c\nhost a clients=x peers=y key={K1}\nhost b clients=x peers=y key={K1}"), 3, "same key"),
            (&format!("cluster c\nhost a clients=x peers=y key={K1}\nhost a clients=x peers=y key={K2}"), 3, "listed twice"),
            (&format!("cluster c\nhost a/b clients=x peers=y key={K1}"), 2, "name"),
            ("cluster c\nnode a", 2, "unknown line kind"),
            (&format!("host a clients=x peers=y key={K1}"), 0, "no `cluster NAME`"),
            ("cluster c", 0, "no `host`"),
        ];
        for (text, line, what) in cases {
            let e = ClusterConfig::parse(text).unwrap_err();
            assert_eq!(e.line, line, "{text:?}: {e}");
            assert!(e.to_string().contains(what), "{text:?}: {e}");
        }
    }
}
