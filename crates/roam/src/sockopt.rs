//! TCP socket options for session transports, through `socket2` (no `unsafe` here).

use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};
use tokio::net::TcpStream;

/// Idle time before the kernel's first keepalive probe.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// Time between keepalive probes.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered probes before the kernel drops the connection.
const KEEPALIVE_RETRIES: u32 = 3;

/// Sets `TCP_NODELAY` (records are already batched), kernel keepalive and
/// `TCP_USER_TIMEOUT` (unacknowledged data for `user_timeout` aborts the
/// connection, so a black-holed transport fails fast instead of retrying for
/// minutes). roam's own heartbeats detect silence anyway; these options only
/// free kernel resources sooner. Failures are logged and ignored.
/// Nothing to set on a Unix-domain transport.
pub(crate) fn configure(transport: &crate::transport::Transport, user_timeout: Duration) {
    let Some(stream) = transport.tcp() else {
        return;
    };
    let sock = SockRef::from(stream);
    if let Err(e) = sock.set_tcp_nodelay(true) {
        tracing::debug!("TCP_NODELAY: {e}");
    }
    let ka = TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_RETRIES);
    if let Err(e) = sock.set_tcp_keepalive(&ka) {
        tracing::debug!("TCP keepalive: {e}");
    }
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if let Err(e) = sock.set_tcp_user_timeout(Some(user_timeout)) {
        tracing::debug!("TCP_USER_TIMEOUT: {e}");
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = user_timeout;
}

/// Sets the socket's receive buffer (`SO_RCVBUF`; the kernel doubles it for
/// its bookkeeping and stops auto-tuning it).
pub(crate) fn set_rcvbuf(stream: &TcpStream, bytes: usize) -> std::io::Result<()> {
    SockRef::from(stream).set_recv_buffer_size(bytes)
}
