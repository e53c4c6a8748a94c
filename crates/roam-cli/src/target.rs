//! Parsing `HOST[:PORT]` relay addresses and pipe/forward targets.

/// The relay's default port.
pub(crate) const DEFAULT_PORT: u16 = 7447;

/// Splits `host`, `host:port`, `[v6]`, `[v6]:port` or a bare IPv6 address.
/// Returns the host (without brackets) and the port if one was given.
pub(crate) fn split_host_port(text: &str) -> Result<(String, Option<u16>), String> {
    let bad_port = |p: &str| format!("invalid port {p:?} in {text:?}");
    if let Some(rest) = text.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("missing ']' in {text:?}"))?;
        return match after {
            "" => Ok((host.to_string(), None)),
            _ => {
                let p = after
                    .strip_prefix(':')
                    .ok_or_else(|| format!("unexpected {after:?} in {text:?}"))?;
                Ok((host.to_string(), Some(p.parse().map_err(|_| bad_port(p))?)))
            }
        };
    }
    match text.matches(':').count() {
        0 => Ok((text.to_string(), None)),
        1 => {
            let (h, p) = text.split_once(':').unwrap_or((text, ""));
            Ok((h.to_string(), Some(p.parse().map_err(|_| bad_port(p))?)))
        }
        _ => Ok((text.to_string(), None)), // bare IPv6 address
    }
}

/// `host:port` text, bracketing IPv6 hosts.
pub(crate) fn join(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The relay address to dial: `HOST[:PORT]` with the default port.
pub(crate) fn relay_addr(text: &str) -> Result<(String, String), String> {
    let (host, port) = split_host_port(text)?;
    if host.is_empty() {
        return Err(format!("missing host in {text:?}"));
    }
    Ok((host.clone(), join(&host, port.unwrap_or(DEFAULT_PORT))))
}

/// A pipe target: `PORT` means `127.0.0.1:PORT` on the relay; else `HOST:PORT`.
/// Returns the target text and its port.
pub(crate) fn pipe_target(text: &str) -> Result<(String, u16), String> {
    if let Ok(port) = text.parse::<u16>() {
        return Ok((join("127.0.0.1", port), port));
    }
    match split_host_port(text)? {
        (host, Some(port)) if !host.is_empty() => Ok((join(&host, port), port)),
        _ => Err(format!("target {text:?} must be PORT or HOST:PORT")),
    }
}

/// Whether a target host names the relay machine itself.
pub(crate) fn is_loopback_host(host: &str) -> bool {
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// An allow-list entry `host:port` where either side may be `*`.
#[derive(Debug, Clone)]
pub(crate) struct AllowRule {
    host: String,
    port: Option<u16>,
}

impl AllowRule {
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let (host, port) = match text.rsplit_once(':') {
            Some((h, "*")) => (
                h.trim_start_matches('[').trim_end_matches(']').to_string(),
                None,
            ),
            _ => match split_host_port(text)? {
                (h, Some(p)) => (h, Some(p)),
                _ => {
                    return Err(format!(
                        "allow rule {text:?} must be HOST:PORT (either may be *)"
                    ))
                }
            },
        };
        if host.contains('*') && host != "*" {
            return Err(format!(
                "allow rule {text:?}: `*` must stand for the whole host (as in `*:22`); partial wildcards such as `10.0.0.*` are not supported, list each address instead"
            ));
        }
        if host.is_empty() {
            return Err(format!(
                "allow rule {text:?} has no host (use `*` for any host)"
            ));
        }
        let host_char = |c: char| c.is_ascii_alphanumeric() || ".-_:%".contains(c);
        if host != "*" && !host.chars().all(host_char) {
            return Err(format!(
                "allow rule {text:?}: {host:?} is not a host name or address"
            ));
        }
        Ok(Self { host, port })
    }

    pub(crate) fn matches(&self, host: &str, port: u16) -> bool {
        (self.host == "*" || self.host.eq_ignore_ascii_case(host))
            && self.port.is_none_or(|p| p == port)
    }
}

impl std::fmt::Display for AllowRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        match self.port {
            Some(p) => write!(f, "{host}:{p}"),
            None => write!(f, "{host}:*"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relay_addresses() {
        assert_eq!(relay_addr("relay").unwrap().1, "relay:7447");
        assert_eq!(relay_addr("relay:9").unwrap().1, "relay:9");
        assert_eq!(relay_addr("[::1]:9").unwrap().1, "[::1]:9");
        assert_eq!(relay_addr("::1").unwrap().1, "[::1]:7447");
        assert!(relay_addr("relay:x").is_err());
    }

    #[test]
    fn pipe_targets() {
        assert_eq!(pipe_target("22").unwrap(), ("127.0.0.1:22".to_string(), 22));
        assert_eq!(
            pipe_target("db:5432").unwrap(),
            ("db:5432".to_string(), 5432)
        );
        assert!(pipe_target("db").is_err());
    }

    #[test]
    fn allow_rules() {
        let r = AllowRule::parse("127.0.0.1:22").unwrap();
        assert!(r.matches("127.0.0.1", 22));
        assert!(!r.matches("127.0.0.1", 23));
        assert!(!r.matches("10.0.0.1", 22));
        let r = AllowRule::parse("127.0.0.1:*").unwrap();
        assert!(r.matches("127.0.0.1", 5432));
        let r = AllowRule::parse("*:*").unwrap();
        assert!(r.matches("example.com", 80));
        // Partial wildcards would never match: refused at start-up.
        for bad in [
            "127.0.0.*:22",
            "*.example.com:22",
            "[::*]:22",
            ":22",
            "host:2*",
            // Found by fuzzing: a bracket in the host did not print back.
            "[[]:2",
            "[l:2",
            "a b:22",
        ] {
            assert!(AllowRule::parse(bad).is_err(), "{bad}");
        }
    }
}
