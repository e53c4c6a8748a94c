//! What a client command (`pipe`, `forward`) tells its user about its session
//! on stderr: a suspension that lasts, the resume after it, a relay that no
//! longer knows the session, and the exit code for a lost session.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use roam::{CloseReason, SessionEvent, SessionHandle};

/// Exit code when the session is lost: the relay restarted without it,
/// expired it, or refused to resume it (documented in `roam pipe --help`).
pub(crate) const EXIT_SESSION_LOST: i32 = 3;

/// A suspension is reported only if it lasts this long (most resume in milliseconds).
const QUIET_SUSPENSION: Duration = Duration::from_secs(2);

/// Prints one `roam: ...` line on stderr. ssh puts the terminal in raw mode
/// while our stderr is that terminal, so lines end with `\r\n` there.
pub(crate) fn notice(msg: &str) {
    let end = if std::io::stderr().is_terminal() {
        "\r\n"
    } else {
        "\n"
    };
    let _ = write!(std::io::stderr(), "roam: {msg}{end}");
}

/// Whether a session ended because the relay no longer holds it.
pub(crate) fn is_session_lost(reason: &CloseReason) -> bool {
    matches!(
        reason,
        CloseReason::Error(
            roam_proto::Error::UnknownSession
                | roam_proto::Error::ResumeRejected
                | roam_proto::Error::Expired
        )
    )
}

/// The message for a lost session.
pub(crate) fn lost_message(reason: &CloseReason, relay: &str) -> String {
    match reason {
        CloseReason::Error(roam_proto::Error::Expired) => format!(
            "the session with relay {relay} expired (suspended longer than its timeout); its connections are gone — start a new one"
        ),
        _ => format!(
            "relay {relay} restarted (or closed this session) and no longer knows it; its connections are gone — start a new one"
        ),
    }
}

/// Reports the session's suspensions and resumes until it ends. Runs as a task.
pub(crate) async fn watch(session: SessionHandle, relay: String) {
    let mut events = session.events();
    let mut reported = false;
    // A refusal was reported since the last resume.
    let mut refused = false;
    let mut pending: Option<tokio::time::Instant> = None;
    loop {
        let ev = match pending {
            Some(at) => tokio::select! {
                ev = events.recv() => ev,
                _ = tokio::time::sleep_until(at) => {
                    pending = None;
                    reported = true;
                    notice(&format!("lost the connection to relay {relay}; session suspended, reconnecting (Ctrl-C or closing the program ends it)"));
                    continue;
                }
            },
            None => events.recv().await,
        };
        match ev {
            Ok(SessionEvent::ResumeRefused { error }) => {
                if !refused {
                    notice(&format!(
                        "relay {relay} refused to resume the session ({error}); retrying for a few seconds in case the refusal was forged"
                    ));
                }
                refused = true;
                reported = true;
            }
            Ok(SessionEvent::Suspended { .. }) if !reported && pending.is_none() => {
                pending = Some(tokio::time::Instant::now() + QUIET_SUSPENSION);
            }
            Ok(SessionEvent::Resumed { suspended_for, .. }) => {
                pending = None;
                if reported {
                    notice(&format!(
                        "session resumed after {:.1} s; nothing was lost",
                        suspended_for.as_secs_f64()
                    ));
                }
                reported = false;
                refused = false;
            }
            Ok(SessionEvent::Closed { .. })
            | Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            _ => {}
        }
    }
}
