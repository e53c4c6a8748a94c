//! One task per live managed session: follows its roam events (suspension:
//! handlers, freeze requests, expiry; resume: handlers, exported
//! attributes; its end). A frozen session has no such task.

use std::sync::{Arc, Weak};
use std::time::SystemTime;

use roam::{SessionEvent, SessionHandle, SuspendReason};
use tokio::io::AsyncWriteExt;
use tokio::sync::broadcast;

use super::{HostInner, RESUME_HANDSHAKE_WAIT};
use crate::attrs::ATTRS_META;
use crate::error::DiscardReason;
use crate::service::Generation;
use crate::session::{FreezeReason, Live};

/// How a watcher starts.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Start {
    Active,
    Suspended,
    /// Restored: waiting for the resume that asked for it.
    Restoring,
}

async fn sleep_opt(t: Option<tokio::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// Follows one live session's events: suspension (handlers, freeze
/// requests, expiry), resume (handlers, exported attributes), its end.
pub(super) async fn watch_live(
    host: Weak<HostInner>,
    live: Arc<Live>,
    mut events: broadcast::Receiver<SessionEvent>,
    start: Start,
) {
    let mut freeze_at = None;
    let mut expire_at = None;
    let mut restoring_until = None;
    match start {
        Start::Active => {}
        Start::Suspended => on_suspended(&live, None, &mut freeze_at, &mut expire_at),
        Start::Restoring => {
            restoring_until = Some(tokio::time::Instant::now() + RESUME_HANDSHAKE_WAIT);
        }
    }
    loop {
        let ev = tokio::select! {
            ev = events.recv() => ev,
            () = sleep_opt(freeze_at) => {
                freeze_at = None;
                live.request_freeze(FreezeReason::SuspendedTooLong);
                continue;
            }
            () = sleep_opt(restoring_until) => {
                restoring_until = None;
                on_suspended(&live, None, &mut freeze_at, &mut expire_at);
                continue;
            }
            () = sleep_opt(expire_at) => {
                if let Some(h) = host.upgrade() {
                    h.discard_many(vec![(live.id, DiscardReason::Expired)]).await;
                }
                return;
            }
        };
        match ev {
            Ok(SessionEvent::Suspended { reason }) => {
                restoring_until = None;
                on_suspended(&live, Some(reason), &mut freeze_at, &mut expire_at);
            }
            // Restored for a resume that did not complete: suspended again
            // now, not when the wait for its handshake runs out (the
            // continuation is out of the store and of etcd until then).
            Ok(SessionEvent::ResumeAbandoned) if restoring_until.is_some() => {
                restoring_until = None;
                on_suspended(&live, None, &mut freeze_at, &mut expire_at);
            }
            Ok(SessionEvent::Resumed { suspended_for, .. }) => {
                restoring_until = None;
                freeze_at = None;
                expire_at = None;
                live.withdraw_freeze();
                let (handlers, handle, msg) = {
                    let mut st = live.lock();
                    st.suspended = None;
                    (
                        st.on_resumed.clone(),
                        st.handle.clone(),
                        st.attrs.exported_message(),
                    )
                };
                for h in handlers {
                    h(suspended_for);
                }
                if let (Some(handle), Some(msg)) = (handle, msg) {
                    send_attrs(&handle, msg);
                }
            }
            Ok(SessionEvent::Detached) => return,
            Ok(SessionEvent::MoveAsked { host: to }) => {
                if let Some(h) = host.upgrade() {
                    let id = live.id;
                    tokio::spawn(async move { h.asked_move(id, to).await });
                }
            }
            Ok(SessionEvent::Closed { reason }) => {
                if let Some(h) = host.upgrade() {
                    let expired =
                        matches!(reason, roam::CloseReason::Error(roam_proto::Error::Expired));
                    h.live_closed(&live, expired).await;
                }
                return;
            }
            Ok(_) => {}
            Err(broadcast::error::RecvError::Lagged(_)) => {
                // Catch up from the session's state.
                let handle = live.lock().handle.clone();
                let Some(handle) = handle else { continue };
                let state = handle.stats().state;
                let was = live.lock().suspended.is_some();
                if state == roam::State::Suspended && !was {
                    on_suspended(&live, None, &mut freeze_at, &mut expire_at);
                } else if state == roam::State::Active && was {
                    live.lock().suspended = None;
                    freeze_at = None;
                    expire_at = None;
                    live.withdraw_freeze();
                }
            }
            Err(broadcast::error::RecvError::Closed) => {
                if let Some(h) = host.upgrade() {
                    h.live_closed(&live, false).await;
                }
                return;
            }
        }
    }
}

fn on_suspended(
    live: &Live,
    reason: Option<SuspendReason>,
    freeze_at: &mut Option<tokio::time::Instant>,
    expire_at: &mut Option<tokio::time::Instant>,
) {
    let now = tokio::time::Instant::now();
    let handlers = {
        let mut st = live.lock();
        st.suspended
            .get_or_insert((now.into_std(), SystemTime::now()));
        st.on_suspended.clone()
    };
    if let Some(r) = reason {
        for h in handlers {
            h(r.clone());
        }
    }
    match live.generation() {
        Generation::Eager => live.request_freeze(FreezeReason::Suspended),
        Generation::Lazy { after } => *freeze_at = Some(now + after),
    }
    *expire_at = Some(now + live.expiry());
}

/// Sends exported attributes on a `roam/attrs` stream (see [`crate::attrs`]).
fn send_attrs(handle: &SessionHandle, msg: Vec<u8>) {
    match handle.open_stream(ATTRS_META) {
        Ok(mut s) => {
            tokio::spawn(async move {
                let _ = s.write_all(&msg).await;
                let _ = s.shutdown().await;
            });
        }
        Err(e) => tracing::debug!("cannot send exported attributes: {e}"),
    }
}
