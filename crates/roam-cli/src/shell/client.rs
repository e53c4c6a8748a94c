//! `roam shell [USER@]HOST [--name N]`: the user's terminal, in raw mode,
//! on a shell the relay keeps.

use std::os::fd::AsFd;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::signal::unix::{signal, SignalKind};

use super::wire::{Decoder, Frame, Open};
use crate::cli::{CliError, CliResult, ShellArgs};
use crate::config::FileConfig;
use crate::connect::{connect_relay, ConnectFailure};

/// `roam shell`.
pub(crate) async fn run(args: ShellArgs, config: &FileConfig) -> CliResult {
    let (user, host) = match args.host.rsplit_once('@') {
        Some((u, h)) if !u.is_empty() => (u.to_string(), h.to_string()),
        _ => (local_user()?, args.host.clone()),
    };
    let (_, relay) = crate::target::relay_addr(&host)?;
    if let Some(n) = &args.name {
        crate::named::check_name(n).map_err(CliError)?;
    }
    let stdin = std::io::stdin();
    if !rustix::termios::isatty(stdin.as_fd()) {
        return Err(CliError(
            "roam shell needs a terminal on stdin (for a command's output, use ssh through `roam pipe`)".into(),
        ));
    }
    let (rows, cols) = window_size();
    let open = Open {
        user: user.clone(),
        name: args.name.clone(),
        term: std::env::var("TERM").unwrap_or_else(|_| "xterm-256color".into()),
        rows,
        cols,
        scrollback: true,
    };
    let session = connect_relay(&relay, args.client.key.as_deref(), config)
        .await
        .map_err(ConnectFailure::into_cli)?;
    tokio::spawn(crate::notices::watch(session.clone(), relay.clone()));
    let stream = session
        .open_stream(&open.meta())
        .map_err(|e| CliError(e.to_string()))?;
    let raw = RawMode::enter().map_err(|e| CliError(format!("terminal: {e}")))?;
    let outcome = interact(&session, stream, open, &host).await;
    drop(raw);
    let closed = std::time::Duration::from_secs(3);
    let _ = tokio::time::timeout(closed, session.close(roam_proto::code::NO_ERROR, "")).await;
    match outcome {
        Outcome::Exited(super::wire::EXIT_UNKNOWN) => {
            eprintln!("\nroam: the shell ended; its exit status was lost in a relay upgrade");
            Ok(0)
        }
        Outcome::Exited(code) => Ok(code.clamp(0, 255)),
        Outcome::Detached(name) => {
            eprintln!(
                "\nroam: detached from shell {name:?}; it keeps running. Re-attach: roam shell {} --name {name}",
                args.host
            );
            Ok(0)
        }
        Outcome::Refused(why) => Err(CliError(format!("relay {relay} refused the shell: {why}"))),
        Outcome::Lost(why) => {
            crate::notices::notice(&why);
            Ok(crate::notices::EXIT_SESSION_LOST)
        }
    }
}

/// How a shell client ended.
enum Outcome {
    /// The shell exited with this status.
    Exited(i32),
    /// The user detached (`~.` or a signal); the shell's name.
    Detached(String),
    /// The relay refused the shell.
    Refused(String),
    /// The stream or session failed.
    Lost(String),
}

/// What the keyboard escape (`~` after a newline, as ssh's) made of input.
#[derive(Debug, Default)]
struct Escape {
    /// At the start of a line.
    line_start: bool,
    /// Saw `~` at the start of a line.
    tilde: bool,
}

impl Escape {
    fn new() -> Self {
        Self {
            line_start: true,
            tilde: false,
        }
    }

    /// Filters typed bytes: returns what goes to the shell, and whether
    /// `~.` asked to detach.
    fn filter(&mut self, input: &[u8]) -> (Vec<u8>, bool) {
        let mut out = Vec::with_capacity(input.len());
        for &b in input {
            if self.tilde {
                self.tilde = false;
                match b {
                    b'.' => return (out, true),
                    b'~' => {
                        out.push(b'~');
                        self.line_start = false;
                        continue;
                    }
                    _ => out.push(b'~'),
                }
            } else if self.line_start && b == b'~' {
                self.tilde = true;
                continue;
            }
            out.push(b);
            self.line_start = b == b'\r' || b == b'\n';
        }
        (out, false)
    }
}

/// Copies the terminal to and from the shell stream until it ends.
async fn interact(
    session: &roam::SessionHandle,
    stream: roam::RoamStream,
    mut open: Open,
    host: &str,
) -> Outcome {
    let (mut rd, mut wr) = tokio::io::split(stream);
    let mut stdin = tokio::io::stdin();
    let mut stdout = tokio::io::stdout();
    let mut winch = signal(SignalKind::window_change()).ok();
    let exit = crate::signals::exit_signal();
    tokio::pin!(exit);
    let mut frames = Decoder::default();
    let mut escape = Escape::new();
    let mut name = String::new();
    let mut kbuf = vec![0u8; 4096];
    let mut sbuf = vec![0u8; 64 * 1024];
    let mut stdin_open = true;
    loop {
        tokio::select! {
            r = stdin.read(&mut kbuf), if stdin_open => match r {
                Ok(0) | Err(_) => stdin_open = false,
                Ok(n) => {
                    let (send, detach) = escape.filter(&kbuf[..n]);
                    if !send.is_empty() {
                        let mut out = Vec::new();
                        Frame::Input(send).encode(&mut out);
                        if let Err(e) = wr.write_all(&out).await {
                            return Outcome::Lost(format!("shell on {host}: {e}"));
                        }
                    }
                    if detach {
                        return Outcome::Detached(name);
                    }
                }
            },
            r = rd.read(&mut sbuf) => match r {
                Ok(0) => return Outcome::Lost(format!("the relay on {host} ended the shell stream")),
                Err(e) => return Outcome::Lost(format!("shell on {host}: {e}")),
                Ok(n) => {
                    frames.push(&sbuf[..n]);
                    loop {
                        match frames.next() {
                            Ok(Some(Frame::Output(b))) => {
                                if stdout.write_all(&b).await.is_err() {
                                    return Outcome::Detached(name);
                                }
                            }
                            Ok(Some(Frame::Attached(a))) => {
                                let what = if a.new { "new shell" } else { "re-attached to shell" };
                                let note = format!("roam: {what} {:?} on {host} (~. detaches)\r\n", a.name);
                                let _ = stdout.write_all(note.as_bytes()).await;
                                name = a.name;
                            }
                            Ok(Some(Frame::Exit(code))) => {
                                let _ = stdout.flush().await;
                                return Outcome::Exited(code);
                            }
                            Ok(Some(Frame::Error(why))) => return Outcome::Refused(why),
                            Ok(Some(Frame::Reattach)) => {
                                // The relay is being upgraded: the shell goes
                                // on in the next one; ask for it there (the
                                // session itself resumes on its own).
                                open.name = Some(name.clone());
                                open.scrollback = false;
                                (open.rows, open.cols) = window_size();
                                match session.open_stream(&open.meta()) {
                                    Ok(s) => {
                                        (rd, wr) = tokio::io::split(s);
                                        frames = Decoder::default();
                                        break;
                                    }
                                    Err(e) => return Outcome::Lost(format!("re-attaching after a relay upgrade: {e}")),
                                }
                            }
                            Ok(Some(other)) => {
                                return Outcome::Lost(format!("unexpected frame from the relay: {other:?}"))
                            }
                            Ok(None) => break,
                            Err(e) => return Outcome::Lost(format!("shell stream from {host}: {e}")),
                        }
                    }
                    let _ = stdout.flush().await;
                }
            },
            Some(()) = recv_winch(winch.as_mut()) => {
                let (rows, cols) = window_size();
                let mut out = Vec::new();
                Frame::Resize { rows, cols }.encode(&mut out);
                if let Err(e) = wr.write_all(&out).await {
                    return Outcome::Lost(format!("shell on {host}: {e}"));
                }
            }
            _ = &mut exit => return Outcome::Detached(name),
        }
    }
}

async fn recv_winch(s: Option<&mut tokio::signal::unix::Signal>) -> Option<()> {
    match s {
        Some(s) => s.recv().await,
        None => std::future::pending().await,
    }
}

/// The terminal's size (24 × 80 if it cannot be read).
fn window_size() -> (u16, u16) {
    match rustix::termios::tcgetwinsize(std::io::stdin().as_fd()) {
        Ok(ws) if ws.ws_row > 0 && ws.ws_col > 0 => (ws.ws_row, ws.ws_col),
        _ => (24, 80),
    }
}

/// The local user's name (the default account on the relay).
fn local_user() -> Result<String, CliError> {
    if let Some(u) = std::env::var("USER").ok().filter(|u| !u.is_empty()) {
        return Ok(u);
    }
    nix::unistd::User::from_uid(nix::unistd::getuid())
        .ok()
        .flatten()
        .map(|u| u.name)
        .ok_or_else(|| CliError("cannot tell the local user name: give USER@HOST".into()))
}

/// The terminal in raw mode until dropped.
struct RawMode {
    saved: nix::sys::termios::Termios,
}

impl RawMode {
    fn enter() -> nix::Result<Self> {
        use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
        let stdin = std::io::stdin();
        let saved = tcgetattr(stdin.as_fd())?;
        let mut raw = saved.clone();
        cfmakeraw(&mut raw);
        tcsetattr(stdin.as_fd(), SetArg::TCSADRAIN, &raw)?;
        Ok(Self { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = nix::sys::termios::tcsetattr(
            std::io::stdin().as_fd(),
            nix::sys::termios::SetArg::TCSADRAIN,
            &self.saved,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::Escape;

    #[test]
    fn tilde_dot_after_a_newline_detaches_and_nothing_else_does() {
        let mut e = Escape::new();
        assert_eq!(e.filter(b"ls\r"), (b"ls\r".to_vec(), false));
        assert!(e.filter(b"~.").1);
        let mut e = Escape::new();
        assert_eq!(e.filter(b"a~."), (b"a~.".to_vec(), false));
        let mut e = Escape::new();
        assert_eq!(e.filter(b"~~x"), (b"~x".to_vec(), false));
        let mut e = Escape::new();
        assert_eq!(e.filter(b"~"), (Vec::new(), false));
        assert_eq!(e.filter(b"q"), (b"~q".to_vec(), false));
        let mut e = Escape::new();
        assert_eq!(e.filter(b"echo\r~"), (b"echo\r".to_vec(), false));
        assert_eq!(e.filter(b"."), (Vec::new(), true));
    }
}
