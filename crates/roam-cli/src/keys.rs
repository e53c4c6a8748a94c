//! Key files, authorized keys, and the known-servers file (trust on first use).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use roam_proto::{Keypair, PublicKey};

use crate::cli::{CliError, CliResult, KeygenArgs};
use crate::config::FileConfig;

/// Reads a private key file (64 hex digits, `#` comment lines allowed).
pub(crate) fn read_key(path: &Path) -> Result<Keypair, CliError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError(format!("cannot read key file {}: {e}", path.display())))?;
    let line = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .unwrap_or("");
    let private: PublicKey = line.parse().map_err(|e| {
        CliError(format!(
            "key file {} is not a roam key ({e}); create one with `roam keygen --out FILE`",
            path.display()
        ))
    })?;
    Ok(Keypair::from_private(private.0))
}

/// Writes a new key file with mode 0600; fails if it exists.
fn write_new_key(path: &Path) -> Result<Keypair, CliError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        crate::paths::ensure_private_dir(dir)
            .map_err(|e| CliError(format!("cannot create {}: {e}", dir.display())))?;
    }
    let kp = Keypair::generate()?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| CliError(format!("cannot create key file {}: {e}", path.display())))?;
    let text = format!(
        "# roam private key; public key {}\n{}\n",
        kp.public(),
        PublicKey(kp.private_bytes())
    );
    f.write_all(text.as_bytes())
        .map_err(|e| CliError(format!("cannot write {}: {e}", path.display())))?;
    Ok(kp)
}

/// Loads the key at `path`, creating it (mode 0600) if it does not exist.
pub(crate) fn load_or_create(path: &Path) -> Result<Keypair, CliError> {
    if path.exists() {
        return read_key(path);
    }
    let kp = write_new_key(path)?;
    tracing::info!(
        "created key file {} (public key {})",
        path.display(),
        kp.public()
    );
    Ok(kp)
}

/// `roam keygen`.
pub(crate) fn keygen(args: KeygenArgs, config: &FileConfig) -> CliResult {
    let path = args
        .out
        .unwrap_or_else(|| crate::paths::state_dir(config).join("client.key"));
    if path.exists() {
        if !args.force {
            return Err(CliError(format!(
                "{} already exists; pass --force to replace it (clients pinned to it will need the new public key)",
                path.display()
            )));
        }
        std::fs::remove_file(&path)
            .map_err(|e| CliError(format!("cannot replace {}: {e}", path.display())))?;
    }
    let kp = write_new_key(&path)?;
    println!("{}", kp.public());
    eprintln!(
        "wrote private key to {} (mode 0600); the line above is its public key",
        path.display()
    );
    Ok(0)
}

/// Reads an authorized-keys file: one hex public key per line, `#` comments,
/// anything after the key (a name) ignored.
pub(crate) fn read_authorized(path: &Path) -> Result<Vec<PublicKey>, CliError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        CliError(format!(
            "cannot read authorized keys {}: {e}",
            path.display()
        ))
    })?;
    parse_authorized(&text, &path.display().to_string()).map_err(CliError)
}

/// Parses the text of an authorized-keys file; `source` names it in errors.
pub(crate) fn parse_authorized(text: &str, source: &str) -> Result<Vec<PublicKey>, String> {
    let mut keys = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let word = line.split_whitespace().next().unwrap_or("");
        keys.push(
            word.parse()
                .map_err(|e| format!("{source}:{}: not a public key ({e})", n + 1))?,
        );
    }
    Ok(keys)
}

/// Parses the text of a known-servers file: `(name, key)` per entry, in file
/// order; blank and `#` lines skipped. `source` names the file in errors.
pub(crate) fn parse_known(text: &str, source: &str) -> Result<Vec<(String, PublicKey)>, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let name = words.next().unwrap_or("");
        let key = words.next().unwrap_or("").parse().map_err(|e| {
            format!(
                "{source}:{}: bad key for {name} ({e}); fix or delete that line",
                n + 1
            )
        })?;
        out.push((name.to_string(), key));
    }
    Ok(out)
}

/// One known-servers line (with its newline).
pub(crate) fn known_line(name: &str, key: &impl std::fmt::Display) -> String {
    format!("{name} {key}\n")
}

/// The known-servers file: lines `host:port hexkey`.
pub(crate) struct KnownServers {
    path: PathBuf,
}

impl KnownServers {
    pub(crate) fn new(state_dir: &Path) -> Self {
        Self {
            path: state_dir.join("known_servers"),
        }
    }

    /// The pinned key for `server`, if any.
    pub(crate) fn lookup(&self, server: &str) -> Result<Option<PublicKey>, CliError> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(CliError(format!(
                    "cannot read {}: {e}",
                    self.path.display()
                )))
            }
        };
        let entries = parse_known(&text, &self.path.display().to_string()).map_err(CliError)?;
        Ok(entries
            .into_iter()
            .find(|(n, _)| n == server)
            .map(|(_, k)| k))
    }

    /// Records a first-use key.
    pub(crate) fn add(&self, server: &str, key: &PublicKey) -> Result<(), CliError> {
        if let Some(dir) = self.path.parent() {
            crate::paths::ensure_private_dir(dir)
                .map_err(|e| CliError(format!("cannot create {}: {e}", dir.display())))?;
        }
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&self.path)
            .map_err(|e| CliError(format!("cannot write {}: {e}", self.path.display())))?;
        f.write_all(known_line(server, key).as_bytes())
            .map_err(|e| CliError(format!("cannot write {}: {e}", self.path.display())))?;
        Ok(())
    }

    /// The loud refusal for a changed key, with both keys and the fix.
    pub(crate) fn mismatch_message(
        &self,
        server: &str,
        expected: &PublicKey,
        actual: &PublicKey,
    ) -> String {
        format!(
            "\n@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@\n\
             @    WARNING: THE ROAM SERVER KEY FOR {server} HAS CHANGED!    \n\
             @@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@\n\
             Someone may be intercepting this connection, or the relay's key was replaced.\n\
             pinned key: {expected}\n\
             server key: {actual}\n\
             Refusing to connect. If you know the relay was re-keyed, remove the line for\n\
             {server} from {path}\n\
             (e.g. sed -i '/^{server_re} /d' {path}) and connect again to trust the new key.",
            path = self.path.display(),
            server_re = server
                .replace('.', "\\.")
                .replace('[', "\\[")
                .replace(']', "\\]"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_file_round_trip_and_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/k.key");
        let kp = load_or_create(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(load_or_create(&path).unwrap().public(), kp.public());
    }

    #[test]
    fn known_servers_pin() {
        let dir = tempfile::tempdir().unwrap();
        let ks = KnownServers::new(dir.path());
        let key = Keypair::generate().unwrap().public();
        assert_eq!(ks.lookup("relay:7447").unwrap(), None);
        ks.add("relay:7447", &key).unwrap();
        assert_eq!(ks.lookup("relay:7447").unwrap(), Some(key));
        assert_eq!(ks.lookup("relay:7448").unwrap(), None);
    }
}
