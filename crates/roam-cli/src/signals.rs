//! The signals that end a client command (`pipe`, `forward`): each one ends
//! it cleanly — streams finished, the session closed with a bounded wait — so
//! that the relay frees the session and its target connections at once
//! instead of holding them suspended until the timeout.

use std::future::Future;

use nix::sys::signal::Signal;
use tokio::signal::unix::{signal, SignalKind};

/// Completes with the signal's number on SIGHUP (ssh sends it to its
/// `ProxyCommand` when it exits), SIGINT or SIGTERM. A signal whose handler
/// cannot be installed is simply not waited for. The handlers are installed
/// by this call, not at the future's first poll: a signal that comes after
/// it is caught even if the future is polled later (in a `select!` whose
/// other branch prints first, as `roam hoard` does).
pub(crate) fn exit_signal() -> impl Future<Output = i32> + Send {
    first_of(&[
        (SignalKind::hangup(), Signal::SIGHUP as i32),
        (SignalKind::interrupt(), Signal::SIGINT as i32),
        (SignalKind::terminate(), Signal::SIGTERM as i32),
    ])
}

/// Completes with the signal's number on SIGINT (Ctrl-C) or SIGTERM: the
/// end of a server or of a long local job. Installed at the call, as
/// [`exit_signal`], and may be polled again for the next one.
pub(crate) fn interrupt_or_terminate() -> impl Future<Output = i32> + Send {
    first_of(&[
        (SignalKind::interrupt(), Signal::SIGINT as i32),
        (SignalKind::terminate(), Signal::SIGTERM as i32),
    ])
}

/// For a named session (`roam pipe --name`), which detaches instead of
/// ending: the exit signals and SIGUSR1 (`roam detach NAME` sends it).
/// Installed at the call, as [`exit_signal`].
pub(crate) fn detach_signal() -> impl Future<Output = i32> + Send {
    first_of(&[
        (SignalKind::hangup(), Signal::SIGHUP as i32),
        (SignalKind::interrupt(), Signal::SIGINT as i32),
        (SignalKind::terminate(), Signal::SIGTERM as i32),
        (SignalKind::user_defined1(), Signal::SIGUSR1 as i32),
    ])
}

/// Installs the handlers of `kinds` now; the future completes with the
/// number of the first of them to arrive (never, if none could be
/// installed). It may be polled again once complete: it then waits for the
/// next of them (`roam run` passes each signal on and goes on).
fn first_of(kinds: &[(SignalKind, i32)]) -> impl Future<Output = i32> + Send {
    let mut streams: Vec<_> = kinds
        .iter()
        .filter_map(|&(k, n)| signal(k).ok().map(|s| (s, n)))
        .collect();
    std::future::poll_fn(move |cx| {
        for (s, n) in &mut streams {
            if s.poll_recv(cx).is_ready() {
                return std::task::Poll::Ready(*n);
            }
        }
        std::task::Poll::Pending
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A signal that comes between the call and the first poll is caught
    /// (without the handlers installed at the call, SIGHUP's default
    /// action would end this test process), and the same future then
    /// waits for the next one.
    #[test]
    fn a_signal_before_the_first_poll_is_caught_and_the_next_too() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut stop = std::pin::pin!(exit_signal());
            nix::sys::signal::raise(Signal::SIGHUP).unwrap();
            let sig = tokio::time::timeout(Duration::from_secs(5), &mut stop).await;
            assert_eq!(sig, Ok(Signal::SIGHUP as i32));
            let again = tokio::time::timeout(Duration::from_millis(50), &mut stop).await;
            assert!(again.is_err(), "no second signal yet: {again:?}");
            nix::sys::signal::raise(Signal::SIGHUP).unwrap();
            let sig = tokio::time::timeout(Duration::from_secs(5), &mut stop).await;
            assert_eq!(sig, Ok(Signal::SIGHUP as i32));
        });
    }
}
