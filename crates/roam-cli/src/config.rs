//! The TOML configuration file (format in `roam --help`). Flags win over it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Everything the file may set.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileConfig {
    /// Overrides the state directory (keys, known_servers, control sockets).
    pub(crate) state_dir: Option<PathBuf>,
    #[serde(default)]
    pub(crate) serve: ServeConfig,
    #[serde(default)]
    pub(crate) client: ClientFileConfig,
    #[serde(default)]
    pub(crate) store: StoreFileConfig,
}

/// `[store]`: defaults for `roam suspend`, `roam resume` and `roam store`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StoreFileConfig {
    /// `--store`: a directory or `s3://BUCKET`.
    pub(crate) location: Option<String>,
    /// `--s3-endpoint`.
    pub(crate) s3_endpoint: Option<String>,
    /// The region S3 requests are signed for (`$ROAM_S3_REGION` wins).
    pub(crate) s3_region: Option<String>,
    /// `--secret`.
    pub(crate) secret: Option<PathBuf>,
}

/// `[serve]`: defaults for `roam serve`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ServeConfig {
    pub(crate) listen: Option<String>,
    pub(crate) allow: Option<Vec<String>>,
    pub(crate) key: Option<PathBuf>,
    pub(crate) authorized_keys: Option<PathBuf>,
    pub(crate) suspend_timeout: Option<String>,
    pub(crate) idle_suspend_timeout: Option<String>,
    /// `--park-after`.
    pub(crate) park_after: Option<String>,
    pub(crate) max_connections: Option<usize>,
    pub(crate) max_sessions: Option<usize>,
    pub(crate) max_sessions_per_ip: Option<usize>,
    pub(crate) max_sessions_per_key: Option<usize>,
    pub(crate) max_targets: Option<usize>,
    pub(crate) max_targets_per_session: Option<usize>,
    /// `--metrics`: where to serve Prometheus metrics.
    pub(crate) metrics: Option<String>,
}

/// `[client]`: defaults for `roam pipe` and `roam forward`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClientFileConfig {
    pub(crate) key: Option<PathBuf>,
    /// Older spelling of `fallback = "never"`.
    #[serde(default)]
    pub(crate) no_fallback: bool,
    /// When `roam pipe` may connect directly (see `roam pipe --help`).
    pub(crate) fallback: Option<crate::cli::Fallback>,
}

impl FileConfig {
    /// Loads `path`, or the default file if it exists, or built-in defaults.
    pub(crate) fn load(path: Option<&Path>) -> Result<Self, String> {
        let (path, required) = match path {
            Some(p) => (p.to_path_buf(), true),
            None => (crate::paths::default_config_file(), false),
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Self::default())
            }
            Err(e) => return Err(format!("cannot read config file {}: {e}", path.display())),
        };
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses the text of a configuration file; `source` names it in errors.
    pub(crate) fn parse(text: &str, source: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| format!("config file {source}: {e}"))
    }
}

/// Parses durations like `3d`, `12h`, `30m`, `90s`, `500ms` (a bare number is seconds).
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let invalid = || format!("invalid duration {text:?}: use e.g. 3d, 12h, 30m, 90s");
    // Milliseconds per unit.
    let unit_ms: u64 = match unit.trim() {
        "" | "s" => 1000,
        "ms" => 1,
        "m" | "min" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(format!(
                "invalid duration unit in {text:?}: use ms, s, m, h or d"
            ))
        }
    };
    let too_long = || format!("duration {text:?} is too long");
    let d = if num.contains('.') {
        // Fractions go through floating point; whole numbers stay exact.
        let n: f64 = num.parse().map_err(|_| invalid())?;
        Duration::try_from_secs_f64(n * unit_ms as f64 / 1000.0).map_err(|_| too_long())?
    } else {
        let n: u64 = match num.parse() {
            Ok(n) => n,
            Err(_) if !num.is_empty() => return Err(too_long()),
            Err(_) => return Err(invalid()),
        };
        let ms = n.checked_mul(unit_ms).ok_or_else(too_long)?;
        Duration::from_millis(ms)
    };
    if d.is_zero() {
        return Err(format!("duration {text:?} must be positive"));
    }
    Ok(d)
}

/// Parses sizes like `16M`, `512K`, `1G` or plain bytes.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let t = text
        .trim()
        .trim_end_matches(['B', 'b'])
        .trim_end_matches("i");
    let (num, mult) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| format!("invalid size {text:?}: use e.g. 16M"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(
            parse_duration("3d").unwrap(),
            Duration::from_secs(3 * 86400)
        );
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("12").unwrap(), Duration::from_secs(12));
        assert!(parse_duration("3 weeks").is_err());
        assert!(parse_duration("0s").is_err());
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("1.2.3s").is_err());
        // Found by fuzzing: an overflowing duration is an error, not a panic,
        // and whole numbers are exact (no floating-point rounding).
        assert!(parse_duration("99999999999999999999999d").is_err());
        assert!(parse_duration("999999999999999.5d").is_err());
        let big = parse_duration("77770707001001").unwrap();
        assert_eq!(
            parse_duration(&format!("{}ms", big.as_millis())).unwrap(),
            big
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("16M").unwrap(), 16 << 20);
        assert_eq!(parse_size("2MiB").unwrap(), 2 << 20);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("99999999999999G").is_err());
    }

    #[test]
    fn config_file_parses() {
        let c: FileConfig = toml::from_str(
            "state_dir = \"/tmp/x\"\n[serve]\nlisten = \"127.0.0.1:1\"\nallow = [\"127.0.0.1:22\"]\n[client]\nno_fallback = true\n",
        )
        .unwrap();
        assert_eq!(c.serve.allow.unwrap(), vec!["127.0.0.1:22".to_string()]);
        assert!(c.client.no_fallback);
    }

    #[test]
    fn serve_limits_parse() {
        let c = FileConfig::parse(
            "[serve]\nidle_suspend_timeout = \"2s\"\nmax_connections = 10\nmax_sessions = 20\nmax_sessions_per_ip = 3\nmax_sessions_per_key = 4\nmax_targets = 50\nmax_targets_per_session = 5\n",
            "test",
        )
        .unwrap();
        assert_eq!(c.serve.idle_suspend_timeout.as_deref(), Some("2s"));
        assert_eq!(
            (
                c.serve.max_connections,
                c.serve.max_sessions,
                c.serve.max_sessions_per_ip,
                c.serve.max_sessions_per_key,
                c.serve.max_targets,
                c.serve.max_targets_per_session
            ),
            (Some(10), Some(20), Some(3), Some(4), Some(50), Some(5))
        );
        assert!(FileConfig::parse("[serve]\nmax_targets = -1\n", "test").is_err());
    }
}
