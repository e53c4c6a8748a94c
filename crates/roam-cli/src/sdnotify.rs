//! systemd's readiness notifications (`sd_notify(3)`) without libsystemd: one
//! datagram of `KEY=VALUE` lines to the socket named by `$NOTIFY_SOCKET` (a
//! path, or an abstract name written with a leading `@`). Without the
//! variable (not under systemd) nothing is sent. `roam serve` says `READY=1`
//! once it listens, `RELOADING=1` when a takeover starts, and its successor
//! names itself the main process (`MAINPID=`) before the old relay exits, so
//! a `Type=notify` unit with `NotifyAccess=all` follows the upgrade
//! (`contrib/systemd/roam-serve.service`).

use std::os::unix::net::UnixDatagram;

/// Sends `state` (newline-separated assignments) to systemd, if it listens;
/// whether it was sent. Failures are logged at debug level only: a service
/// works the same without the notifications.
pub(crate) fn notify(state: &str) -> bool {
    let Some(target) = std::env::var_os("NOTIFY_SOCKET").filter(|v| !v.is_empty()) else {
        return false;
    };
    let sent = UnixDatagram::unbound().and_then(|sock| {
        use std::os::unix::ffi::OsStrExt;
        let bytes = target.as_bytes();
        match bytes.strip_prefix(b"@") {
            Some(name) => {
                use std::os::linux::net::SocketAddrExt;
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
                sock.send_to_addr(state.as_bytes(), &addr)
            }
            None => sock.send_to(state.as_bytes(), &target),
        }
    });
    match sent {
        Ok(_) => true,
        Err(e) => {
            tracing::debug!("systemd notification {state:?} not sent: {e}");
            false
        }
    }
}
