//! The signals that end a client command (`pipe`, `forward`): each one ends
//! it cleanly — streams finished, the session closed with a bounded wait — so
//! that the relay frees the session and its target connections at once
//! instead of holding them suspended until the timeout.

use nix::sys::signal::Signal;
use tokio::signal::unix::{signal, SignalKind};

/// Completes with the signal's number on SIGHUP (ssh sends it to its
/// `ProxyCommand` when it exits), SIGINT or SIGTERM. A signal whose handler
/// cannot be installed is simply not waited for.
pub(crate) async fn exit_signal() -> i32 {
    first_of(&[
        (SignalKind::hangup(), Signal::SIGHUP as i32),
        (SignalKind::interrupt(), Signal::SIGINT as i32),
        (SignalKind::terminate(), Signal::SIGTERM as i32),
    ])
    .await
}

/// For a named session (`roam pipe --name`), which detaches instead of
/// ending: the exit signals and SIGUSR1 (`roam detach NAME` sends it).
pub(crate) async fn detach_signal() -> i32 {
    first_of(&[
        (SignalKind::hangup(), Signal::SIGHUP as i32),
        (SignalKind::interrupt(), Signal::SIGINT as i32),
        (SignalKind::terminate(), Signal::SIGTERM as i32),
        (SignalKind::user_defined1(), Signal::SIGUSR1 as i32),
    ])
    .await
}

/// Completes with the number of the first of `kinds` to arrive.
async fn first_of(kinds: &[(SignalKind, i32)]) -> i32 {
    let mut streams: Vec<_> = kinds
        .iter()
        .filter_map(|&(k, n)| signal(k).ok().map(|s| (s, n)))
        .collect();
    if streams.is_empty() {
        return std::future::pending().await;
    }
    std::future::poll_fn(|cx| {
        for (s, n) in &mut streams {
            if s.poll_recv(cx).is_ready() {
                return std::task::Poll::Ready(*n);
            }
        }
        std::task::Poll::Pending
    })
    .await
}
