//! Who a shell runs as, and how it is started as them.
//!
//! A shell request names an account; the client's key must be in that
//! account's authorized keys (`--shell-keys`, by default
//! `~USER/.config/roam/authorized_keys`), checked as sshd's `StrictModes`
//! checks its files: the file must be a regular file owned by the account
//! or root and writable by nobody else, and so must every directory it is
//! reached through, from its own up to `/` (the account's home among them
//! when the file is in it) — a directory someone else can write lets them
//! put another file there. Symlinks are followed, as for the file itself:
//! both the path as written and the file's real path are checked. The one
//! exception, above the account's home only (sshd stops at the home): a
//! directory with the sticky bit, owned by root or the account, such as
//! `/tmp`, passes although others may write it, as they can add entries
//! there but not rename or remove those of others, so the path to the file
//! cannot be swapped (a directory they add is theirs, and fails the check).
//!
//! A relay running as root starts the shell through util-linux's `setpriv`
//! with the account's uid, gid and supplementary groups (those `/etc/group`
//! and NSS give it, as `initgroups` does for an ssh login), and nothing of
//! the relay's own groups or capabilities. Any other relay starts shells
//! only as its own user. The shell starts in the account's home, entered as
//! the account (`env -C` after `setpriv`); when the account cannot enter it
//! (missing, not a directory, not searchable), the shell starts in `/`
//! instead and its terminal first shows why, as sshd's "Could not chdir to
//! home directory". `setsid --ctty` makes the pty the shell's controlling
//! terminal. So none of this needs `unsafe` (std cannot set supplementary
//! groups, and a `pre_exec` is `unsafe`).

use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use roam_proto::PublicKey;

/// The `PATH` of the shell and of the commands that start it.
const PATH: &str = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin";

/// How long a check made as the account (entering its home, running the
/// relay's binary) may take (a home on a network file system that hangs).
const HOME_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// The account a shell runs as.
pub(super) struct Account {
    pub(super) name: String,
    uid: u32,
    gid: u32,
    home: PathBuf,
    shell: PathBuf,
}

/// How to start an account's shell: the command (its stdio left to the
/// caller) and what its terminal shows first.
pub(super) struct Login {
    pub(super) cmd: tokio::process::Command,
    /// Why the shell does not start in the home, for its terminal.
    pub(super) notice: Option<String>,
    /// The program started as the shell (for messages).
    pub(super) shell: PathBuf,
    /// What runs the shell's worker processes as the account (the same
    /// `setpriv` prefix as the shell's); empty when the relay is the
    /// account.
    pub(super) worker_as: Vec<OsString>,
}

impl Account {
    /// Looks `user` up and checks that `key` may have a shell there.
    pub(super) fn authorize(user: &str, key: &PublicKey, pattern: &str) -> Result<Self, String> {
        let u = nix::unistd::User::from_name(user)
            .map_err(|e| format!("looking up user {user:?}: {e}"))?
            .ok_or_else(|| format!("no user {user:?} on this host"))?;
        let me = nix::unistd::geteuid();
        if !me.is_root() && u.uid != me {
            return Err(format!(
                "this relay runs as uid {me} and can start shells only as that user, not as {user:?}"
            ));
        }
        let path = PathBuf::from(
            pattern
                .replace("%h", &u.dir.to_string_lossy())
                .replace("%u", &u.name),
        );
        strict_modes(&path, user, u.uid.as_raw(), &u.dir)?;
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let keys = crate::keys::parse_authorized(&text, &path.display().to_string())?;
        if !keys.contains(key) {
            return Err(format!(
                "the client key {key} is not in {} (user {user:?})",
                path.display()
            ));
        }
        Ok(Self {
            name: u.name,
            uid: u.uid.as_raw(),
            gid: u.gid.as_raw(),
            home: u.dir,
            shell: if u.shell.as_os_str().is_empty() {
                PathBuf::from("/bin/sh")
            } else {
                u.shell
            },
        })
    }

    /// The command that starts the account's login shell (`program`
    /// instead, if given) with `TERM` set to `term`: what a relay running
    /// as root needs to become the account, then `env -C` to its home (or
    /// `/`), then `setsid --ctty`.
    pub(super) async fn login(&self, program: Option<&Path>, term: &str) -> Result<Login, String> {
        let become_account = self.become_account()?;
        let (dir, notice) = self.start_dir(&become_account).await?;
        let shell = program.unwrap_or(&self.shell).to_path_buf();
        let mut argv = become_account.clone();
        argv.extend(["env".into(), "-C".into(), dir.into_os_string()]);
        // `--ctty`: the pty (stdin) becomes the new session's controlling
        // terminal.
        argv.extend([
            "setsid".into(),
            "--ctty".into(),
            shell.clone().into(),
            "-l".into(),
        ]);
        let mut cmd = command(&argv);
        cmd.env("HOME", &self.home)
            .env("USER", &self.name)
            .env("LOGNAME", &self.name)
            .env("SHELL", &shell)
            .env("TERM", term);
        // The worker runs behind the same prefix.
        let worker_as = become_account;
        if !worker_as.is_empty() {
            self.can_run_worker(&worker_as).await?;
        }
        Ok(Login {
            cmd,
            notice,
            shell,
            worker_as,
        })
    }

    /// Checks that the account can execute this relay's binary, which its
    /// shell's worker processes run as it (`test -x` as the account): a
    /// relay installed where only root may run it gets a precise refusal
    /// instead of workers that die at start.
    async fn can_run_worker(&self, become_account: &[OsString]) -> Result<(), String> {
        let exe = std::env::current_exe()
            .map_err(|e| format!("this relay's own binary (for the shell's worker): {e}"))?;
        let checking = format!("checking that {:?} can run {}", self.name, exe.display());
        let out = probe_as(
            become_account,
            &["test".into(), "-x".into(), exe.clone().into()],
            &checking,
        )
        .await?;
        let status = out.status;
        match status.code() {
            Some(0) => Ok(()),
            Some(1) => Err(format!(
                "user {:?} cannot execute {}, which runs its shell's terminal as that user: \
                 install roam where every account can run it (e.g. /usr/local/bin)",
                self.name,
                exe.display()
            )),
            _ => Err(format!("{checking}: {status}")),
        }
    }

    /// The `setpriv` command line (up to its `--`) that gives a process the
    /// account's uid, gid and supplementary groups, when this relay runs
    /// as root and the account is not root; else nothing (the shell runs
    /// as the relay does).
    fn become_account(&self) -> Result<Vec<OsString>, String> {
        become_ids(&self.name, self.uid, self.gid)
    }

    /// Where the shell starts: the home if the account can enter it, else
    /// `/` and the notice that says why not. `become_account` is what
    /// [`Self::become_account`] gave.
    async fn start_dir(
        &self,
        become_account: &[OsString],
    ) -> Result<(PathBuf, Option<String>), String> {
        let why_not = if become_account.is_empty() {
            // The relay is the account: it asks the kernel itself.
            match nix::unistd::access(&self.home, nix::unistd::AccessFlags::X_OK) {
                Ok(()) if self.home.is_dir() => None,
                Ok(()) => Some(nix::errno::Errno::ENOTDIR.desc().to_string()),
                Err(e) => Some(e.desc().to_string()),
            }
        } else {
            self.enter_home_as_account(become_account).await?
        };
        Ok(match why_not {
            None => (self.home.clone(), None),
            Some(why) => {
                tracing::warn!(
                    "user {:?} cannot enter its home {}: {why}; its shell starts in /",
                    self.name,
                    self.home.display()
                );
                (
                    PathBuf::from("/"),
                    Some(format!(
                        "Could not chdir to home directory {}: {why}; starting in /\n",
                        self.home.display()
                    )),
                )
            }
        })
    }

    /// Tries, as the account (with all its groups), to enter its home
    /// (`env -C HOME true`): `None` if it can, else why not as `env` says
    /// it ("Permission denied", ...).
    async fn enter_home_as_account(
        &self,
        become_account: &[OsString],
    ) -> Result<Option<String>, String> {
        let checking = format!(
            "checking that {:?} can enter {}",
            self.name,
            self.home.display()
        );
        let out = probe_as(
            become_account,
            &[
                "env".into(),
                "-C".into(),
                self.home.clone().into(),
                "true".into(),
            ],
            &checking,
        )
        .await?;
        if out.status.success() {
            return Ok(None);
        }
        let said = String::from_utf8_lossy(&out.stderr);
        let said = said.trim();
        // "env: cannot change directory to 'HOME': REASON" (C locale: the
        // environment is cleared).
        match said
            .lines()
            .last()
            .filter(|l| l.contains("cannot change directory"))
        {
            Some(line) => Ok(Some(
                line.rsplit_once(": ")
                    .map_or(line, |(_, why)| why)
                    .to_string(),
            )),
            None => Err(format!("{checking}: {} ({said})", out.status)),
        }
    }
}

/// Runs `argv` behind `become_account` (a check made as the account), its
/// stderr kept, within [`HOME_CHECK_TIMEOUT`]; `checking` says what for in
/// the errors.
async fn probe_as(
    become_account: &[OsString],
    argv: &[OsString],
    checking: &str,
) -> Result<std::process::Output, String> {
    let mut all = become_account.to_vec();
    all.extend_from_slice(argv);
    let mut probe = command(&all);
    probe
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    tokio::time::timeout(HOME_CHECK_TIMEOUT, probe.output())
        .await
        .map_err(|_| format!("{checking}: no answer in {HOME_CHECK_TIMEOUT:?}"))?
        .map_err(|e| format!("{checking} (with setpriv from util-linux): {e}"))
}

/// [`Account::become_account`] for the account named `user`, looked up
/// again (a shell handed over by another relay knows only its account's
/// name).
pub(super) fn become_user(user: &str) -> Result<Vec<OsString>, String> {
    let u = nix::unistd::User::from_name(user)
        .map_err(|e| format!("looking up user {user:?}: {e}"))?
        .ok_or_else(|| format!("no user {user:?} on this host"))?;
    become_ids(&u.name, u.uid.as_raw(), u.gid.as_raw())
}

/// The `setpriv` prefix that runs a command as `name` (`uid`, `gid` and
/// the supplementary groups `/etc/group` gives it), when this process is
/// root and the account is not; else empty.
fn become_ids(name: &str, uid: u32, gid: u32) -> Result<Vec<OsString>, String> {
    if !nix::unistd::geteuid().is_root() || uid == 0 {
        return Ok(Vec::new());
    }
    let c_name = std::ffi::CString::new(name.as_bytes())
        .map_err(|_| format!("user name {name:?} has a NUL byte"))?;
    let groups = nix::unistd::getgrouplist(&c_name, nix::unistd::Gid::from_raw(gid))
        .map_err(|e| format!("the groups of user {name:?}: {e}"))?;
    let groups: Vec<String> = groups.iter().map(|g| g.as_raw().to_string()).collect();
    Ok(vec![
        "setpriv".into(),
        format!("--reuid={uid}").into(),
        format!("--regid={gid}").into(),
        // Never empty: the list has the account's own group.
        format!("--groups={}", groups.join(",")).into(),
        "--".into(),
    ])
}

/// A command running `argv` in `/` with only `PATH` in its environment.
fn command(argv: &[OsString]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .current_dir("/")
        .env_clear()
        .env("PATH", PATH);
    cmd
}

/// sshd's `StrictModes` for the keys file at `path` of `user` (`uid`,
/// home `home`): see the module's docs.
fn strict_modes(path: &Path, user: &str, uid: u32, home: &Path) -> Result<(), String> {
    let rule = format!("must be owned by {user:?} or root and writable by nobody else");
    let meta = std::fs::metadata(path).map_err(|e| {
        format!(
            "user {user:?} has no roam authorized keys ({}: {e}); add the client's key there",
            path.display()
        )
    })?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", path.display()));
    }
    if let Some(wrong) = wrong_owner_or_mode(&meta, uid, false) {
        return Err(format!("{} {rule}: it is {wrong}", path.display()));
    }
    // Every directory of the path as written (each followed, as the file
    // is), then of its real path: one the other does not pass through is
    // as good a place to swap the file from.
    let real = std::fs::canonicalize(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let real_home = std::fs::canonicalize(home).ok();
    let mut seen = std::collections::HashSet::new();
    for dir in path.ancestors().skip(1).chain(real.ancestors().skip(1)) {
        if dir.as_os_str().is_empty() || !seen.insert(dir) {
            continue;
        }
        let in_home =
            dir.starts_with(home) || real_home.as_deref().is_some_and(|h| dir.starts_with(h));
        let meta = std::fs::metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        if let Some(wrong) = wrong_owner_or_mode(&meta, uid, !in_home) {
            let really = match std::fs::canonicalize(dir) {
                Ok(r) if r != dir => format!(" (really {})", r.display()),
                _ => String::new(),
            };
            return Err(format!(
                "the directory {}{really} on the way to {} is {wrong}; each directory up to / {rule}",
                dir.display(),
                path.display()
            ));
        }
    }
    Ok(())
}

/// What is wrong with a file or directory of a keys file's path for the
/// account `uid`, if anything: owned by someone else, or writable by its
/// group or others (`sticky_ok`: unless it has the sticky bit).
fn wrong_owner_or_mode(meta: &std::fs::Metadata, uid: u32, sticky_ok: bool) -> Option<String> {
    let owner = meta.uid();
    if owner != uid && owner != 0 {
        let name = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(owner))
            .ok()
            .flatten()
            .map_or_else(|| "no such user".to_string(), |u| u.name);
        return Some(format!("owned by uid {owner} ({name})"));
    }
    let mode = meta.mode() & 0o7777;
    let sticky = mode & 0o1000 != 0;
    let by = match (mode & 0o020 != 0, mode & 0o002 != 0) {
        _ if sticky_ok && sticky => return None,
        (true, true) => "its group and others",
        (true, false) => "its group",
        (false, true) => "others",
        (false, false) => return None,
    };
    Some(format!("writable by {by} (mode {mode:04o})"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn chmod(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// The keys file and the directories it is reached through, checked
    /// as the relay's own user (the owner of everything here): a
    /// directory writable by its group or others in the home is refused,
    /// naming it, also when reached through a symlink; above the home a
    /// sticky one passes.
    #[test]
    fn strict_modes_names_the_directory_that_others_may_write() {
        let me = nix::unistd::geteuid().as_raw();
        let tmp = tempfile::tempdir().unwrap();
        // A home of its own under a sticky, world-writable directory (as
        // /tmp): fine above the home.
        let above = tmp.path().join("above");
        let home = above.join("home");
        let roam = home.join(".config/roam");
        std::fs::create_dir_all(&roam).unwrap();
        for d in [tmp.path(), &above, &home, &home.join(".config"), &roam] {
            chmod(d, 0o755);
        }
        chmod(&above, 0o1777);
        let keys = roam.join("authorized_keys");
        std::fs::write(&keys, "").unwrap();
        chmod(&keys, 0o600);
        let check = || strict_modes(&keys, "someone", me, &home);
        if let Err(e) = check() {
            // The temporary directory itself is somewhere unusual.
            eprintln!("SKIP: the test's own directories do not pass: {e}");
            return;
        }

        chmod(&home.join(".config"), 0o775);
        let e = check().unwrap_err();
        assert!(
            e.contains(&format!(
                "the directory {} on the way to {} is writable by its group (mode 0775)",
                home.join(".config").display(),
                keys.display()
            )),
            "{e}"
        );
        chmod(&home.join(".config"), 0o1777);
        let e = check().unwrap_err();
        assert!(
            e.contains("is writable by its group and others (mode 1777)"),
            "sticky is no excuse in the home: {e}"
        );
        chmod(&home.join(".config"), 0o755);
        chmod(&home, 0o757);
        let e = check().unwrap_err();
        assert!(e.contains("writable by others (mode 0757)"), "{e}");
        chmod(&home, 0o755);
        chmod(&above, 0o777);
        let e = check().unwrap_err();
        assert!(
            e.contains(&format!("{} on the way", above.display())),
            "{e}"
        );
        chmod(&above, 0o1777);
        check().unwrap();

        // The roam directory as a symlink to one that others may write:
        // the real path is checked too.
        let elsewhere = tmp.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        chmod(&elsewhere, 0o777);
        std::fs::rename(&keys, elsewhere.join("authorized_keys")).unwrap();
        std::fs::remove_dir(&roam).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &roam).unwrap();
        let e = check().unwrap_err();
        assert!(
            e.contains(&format!(
                "the directory {} (really {}) on the way to {} is writable by its group and others (mode 0777)",
                roam.display(),
                elsewhere.canonicalize().unwrap().display(),
                keys.display()
            )),
            "{e}"
        );
        chmod(&elsewhere, 0o755);
        check().unwrap();

        // The file itself.
        chmod(&keys, 0o640);
        check().unwrap();
        chmod(&keys, 0o660);
        let e = check().unwrap_err();
        assert!(e.contains("writable by its group (mode 0660)"), "{e}");
    }
}
