//! Where roam keeps its files.

use std::path::PathBuf;

use crate::config::FileConfig;

/// The state directory: `state_dir` from the config file, else
/// `$ROAM_STATE_DIR`, else `$XDG_STATE_HOME/roam`, else `~/.local/state/roam`.
pub(crate) fn state_dir(config: &FileConfig) -> PathBuf {
    if let Some(d) = std::env::var_os("ROAM_STATE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = &config.state_dir {
        return d.clone();
    }
    if let Some(d) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("roam");
    }
    home().join(".local/state/roam")
}

/// The default configuration file: `$XDG_CONFIG_HOME/roam/config.toml` or
/// `~/.config/roam/config.toml`.
pub(crate) fn default_config_file() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_CONFIG_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("roam/config.toml");
    }
    home().join(".config/roam/config.toml")
}

fn home() -> PathBuf {
    std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from)
}

/// Creates `dir` (and parents) readable by the owner only.
pub(crate) fn ensure_private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// Writes a state file so that it is either wholly there or not touched: the
/// bytes go to a temporary file beside `path` (created with `mode`), which is
/// flushed to disk and then renamed over `path` (or, with `replace == false`,
/// linked to `path`, failing with `AlreadyExists` if it exists); the
/// directory is synced too. On any error (a full disk, say) the temporary
/// file is removed and `path` keeps its old contents, or stays absent.
pub(crate) fn write_atomic(
    path: &std::path::Path,
    bytes: &[u8],
    mode: u32,
    replace: bool,
) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map_or_else(|| "state".into(), |n| n.to_string_lossy().into_owned());
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.tmp.{}.{n}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        if replace {
            std::fs::rename(&tmp, path)?;
        } else {
            std::fs::hard_link(&tmp, path)?;
            std::fs::remove_file(&tmp)?;
        }
        std::fs::File::open(&dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
