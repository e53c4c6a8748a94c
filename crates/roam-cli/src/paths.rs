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
