//! Client: the first dial and handshake; re-dials are the driver's job.

use tokio::time::Instant;

use roam_proto::Session;

use crate::driver::{dial, Conn, Dialer, Driver, Kind};
use crate::handle::{Inner, SessionEvent, SessionHandle};
use crate::{ClientConfig, Error};

/// Connects to the roam server at `addr` (`host:port`, resolved again on every
/// re-dial) and completes the handshake. The returned session re-dials and
/// resumes on its own whenever its transport is lost, until it is closed or
/// expires.
///
/// Errors: [`Error::Unreachable`] if no TCP connection could be made,
/// [`Error::Closed`] with the protocol's reason if the handshake failed (not a
/// roam server, server key mismatch, unauthorized key, ...).
pub async fn connect(addr: &str, config: ClientConfig) -> Result<SessionHandle, Error> {
    let (sock, peer) = tokio::time::timeout(config.connect_timeout, dial(addr))
        .await
        .unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "connect timed out",
            ))
        })
        .map_err(|source| Error::Unreachable {
            addr: addr.to_string(),
            source,
        })?;
    crate::sockopt::configure(&sock, config.proto.session.suspend_after * 2);

    let mut session = Session::client(config.proto.clone());
    let tid = session.connect(Instant::now().into_std(), Some(peer))?;
    let inner = Inner::new(session);
    let mut events = inner.events.subscribe();
    let handle = SessionHandle::new(inner.clone());
    let driver = Driver::new(
        inner,
        Conn::new(tid, sock, peer, None),
        Kind::Client(Box::new(Dialer::new(addr.to_string(), config))),
    );
    tokio::spawn(driver.run());

    loop {
        match events.recv().await {
            Ok(SessionEvent::Connected { .. }) => return Ok(handle),
            Ok(SessionEvent::Closed {
                reason: roam_proto::CloseReason::Error(e),
            }) => return Err(Error::Protocol(e)),
            Ok(SessionEvent::Closed { reason }) => return Err(Error::Closed(reason)),
            Ok(_) => {}
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                if handle.stats().state == roam_proto::State::Active {
                    return Ok(handle);
                }
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                return Err(Error::Closed(roam_proto::CloseReason::Error(
                    roam_proto::Error::HandshakeFailed,
                )))
            }
        }
    }
}
