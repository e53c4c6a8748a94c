//! Key files, authorized keys, and the known-servers file (trust on first use).

use std::path::{Path, PathBuf};

use roam_proto::{Keypair, PublicKey};

use crate::cli::{CliError, CliResult, KeygenArgs};
use crate::config::FileConfig;

/// The first line of every key file `roam` writes.
const KEY_HEADER: &str = "# roam private key";

/// Reads a private key file (64 hex digits, `#` comment lines allowed).
/// Refuses a file that others may read, as ssh does: anyone who can read it
/// can act as this client or relay.
pub(crate) fn read_key(path: &Path) -> Result<Keypair, CliError> {
    use std::os::unix::fs::PermissionsExt;
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError(format!("cannot read key file {}: {e}", path.display())))?;
    let mode = std::fs::metadata(path)
        .map_err(|e| CliError(format!("cannot read key file {}: {e}", path.display())))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(CliError(format!(
            "key file {} is accessible by other users (mode {:04o}); a private key must be readable by its owner only. Fix it with `chmod 600 {}`",
            path.display(),
            mode & 0o7777,
            path.display()
        )));
    }
    let line = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .unwrap_or("");
    let private: PublicKey = line.parse().map_err(|e| {
        CliError(format!(
            "key file {} is not a roam key ({e}){}; create one with `roam keygen --out FILE`",
            path.display(),
            if text.is_empty() { ", it is empty" } else { "" }
        ))
    })?;
    Ok(Keypair::from_private(private.0))
}

/// The text of a key file for `kp`.
fn key_file_text(kp: &Keypair) -> String {
    format!(
        "{KEY_HEADER}; public key {}\n{}\n",
        kp.public(),
        PublicKey(kp.private_bytes())
    )
}

/// Writes a new key file with mode 0600, atomically (nothing is left behind
/// on a full disk); fails with `AlreadyExists` if it exists, or replaces it
/// when `replace` is set.
fn write_key(path: &Path, replace: bool) -> Result<Keypair, WriteKeyError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        crate::paths::ensure_private_dir(dir).map_err(|e| {
            WriteKeyError::Other(CliError(format!("cannot create {}: {e}", dir.display())))
        })?;
    }
    let kp = Keypair::generate().map_err(|e| WriteKeyError::Other(e.into()))?;
    match crate::paths::write_atomic(path, key_file_text(&kp).as_bytes(), 0o600, replace) {
        Ok(()) => Ok(kp),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(WriteKeyError::Exists),
        Err(e) => Err(WriteKeyError::Other(CliError(format!(
            "cannot write key file {}: {e}; nothing was written",
            path.display()
        )))),
    }
}

/// Why [`write_key`] failed.
enum WriteKeyError {
    /// The file exists (another process may have just created it).
    Exists,
    /// Anything else, explained.
    Other(CliError),
}

/// Loads the key at `path`, creating it (mode 0600) if it does not exist.
pub(crate) fn load_or_create(path: &Path) -> Result<Keypair, CliError> {
    if path.exists() {
        return read_key(path);
    }
    match write_key(path, false) {
        Ok(kp) => {
            tracing::info!(
                "created key file {} (public key {})",
                path.display(),
                kp.public()
            );
            Ok(kp)
        }
        // Another process created it meanwhile: use theirs.
        Err(WriteKeyError::Exists) => read_key(path),
        Err(WriteKeyError::Other(e)) => Err(e),
    }
}

/// `roam keygen`.
pub(crate) fn keygen(args: KeygenArgs, config: &FileConfig) -> CliResult {
    let path = args
        .out
        .unwrap_or_else(|| crate::paths::state_dir(config).join("client.key"));
    if path.exists() && !args.force {
        return Err(CliError(format!(
            "{} already exists; pass --force to replace it (clients pinned to it will need the new public key)",
            path.display()
        )));
    }
    let kp = match write_key(&path, args.force) {
        Ok(kp) => kp,
        Err(WriteKeyError::Exists) => {
            return Err(CliError(format!(
                "{} already exists; pass --force to replace it",
                path.display()
            )))
        }
        Err(WriteKeyError::Other(e)) => return Err(e),
    };
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
    if text.lines().any(|l| l.trim_start().starts_with(KEY_HEADER)) {
        return Err(format!(
            "{source} is a private key file, not a list of public keys; list clients' public keys (what `roam keygen` prints), one per line"
        ));
    }
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
    if keys.is_empty() {
        return Err(format!(
            "{source} lists no keys, so every client would be refused; add clients' public keys (what `roam keygen` prints), one per line"
        ));
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

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
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

    /// Records a first-use key: the file is rewritten atomically, so a full
    /// disk leaves it as it was.
    pub(crate) fn add(&self, server: &str, key: &PublicKey) -> Result<(), CliError> {
        if let Some(dir) = self.path.parent() {
            crate::paths::ensure_private_dir(dir)
                .map_err(|e| CliError(format!("cannot create {}: {e}", dir.display())))?;
        }
        let mut text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => {
                return Err(CliError(format!(
                    "cannot read {}: {e}",
                    self.path.display()
                )))
            }
        };
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&known_line(server, key));
        crate::paths::write_atomic(&self.path, text.as_bytes(), 0o600, true)
            .map_err(|e| CliError(format!("cannot write {}: {e}", self.path.display())))
    }

    /// The loud refusal for a changed key, with both keys and the fix.
    pub(crate) fn mismatch_message(
        &self,
        server: &str,
        expected: &PublicKey,
        actual: &PublicKey,
        noun: &str,
    ) -> String {
        format!(
            "\n@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@\n\
             @    WARNING: THE ROAM SERVER KEY FOR {server} HAS CHANGED!    \n\
             @@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@\n\
             Someone may be intercepting this connection, or the {noun}'s key was replaced.\n\
             pinned key: {expected}\n\
             server key: {actual}\n\
             Refusing to connect. If you know the {noun} was re-keyed, remove the line for\n\
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
