//! Client: the first dial and handshake; re-dials are the driver's job.

use std::future::poll_fn;
use std::task::Poll;

use tokio::time::Instant;

use roam_proto::Session;

use crate::driver::{dial, Conn, Dialer, Driver, Kind};
use crate::handle::{Inner, SessionHandle};
use crate::transport::{network_peer, Transport, UNIX_PEER};
use crate::{ClientConfig, Error};

/// Connects to the roam server at `addr` (`host:port`, resolved again on every
/// re-dial, or `unix:PATH` for a server on a Unix-domain socket) and
/// completes the handshake. The returned session re-dials and resumes on its
/// own whenever its transport is lost, until it is closed or expires.
///
/// Errors: [`Error::Unreachable`] if no connection could be made,
/// [`Error::Closed`] with the protocol's reason if the handshake failed (not a
/// roam server, server key mismatch, unauthorized key, ...).
pub async fn connect(addr: &str, config: ClientConfig) -> Result<SessionHandle, Error> {
    let (sock, _) = tokio::time::timeout(config.connect_timeout, dial(addr))
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
    connect_over(sock, addr, config).await
}

/// Runs the handshake over a transport the caller already holds (a socket
/// pair, a descriptor adopted with [`Transport::adopt`], a connection made
/// through a proxy) instead of dialing; `addr` is where later re-dials go
/// (as for [`connect`]). Errors as for [`connect`], except that there is no
/// first dial to fail.
pub async fn connect_over(
    transport: Transport,
    addr: &str,
    config: ClientConfig,
) -> Result<SessionHandle, Error> {
    let peer = transport.peer().unwrap_or(UNIX_PEER);
    crate::sockopt::configure(&transport, config.proto.session.suspend_after * 2);

    let mut session = Session::client(config.proto.clone());
    let tid = session.connect(Instant::now().into_std(), network_peer(peer))?;
    let inner = Inner::new(session);
    let handle = SessionHandle::new(inner.clone());
    let driver = Driver::new(
        inner.clone(),
        Conn::new(tid, transport, peer, None),
        Kind::Client(Box::new(Dialer::new(addr.to_string(), config))),
    );
    tokio::spawn(driver.run::<crate::driver::AsClient>());

    // Waits on the shared state, not the event channel: subscribing would
    // create the channel (its slots) for every session, used or not.
    let closed = poll_fn(|cx| {
        let mut sh = inner.lock();
        if sh.connected {
            return Poll::Ready(None);
        }
        if let Some(reason) = sh.closed.as_deref() {
            return Poll::Ready(Some(reason.clone()));
        }
        if !sh.closed_wakers.iter().any(|w| w.will_wake(cx.waker())) {
            sh.closed_wakers.push(cx.waker().clone());
        }
        Poll::Pending
    })
    .await;
    match closed {
        None => Ok(handle),
        Some(roam_proto::CloseReason::Error(e)) => Err(Error::Protocol(e)),
        Some(reason) => Err(Error::Closed(reason)),
    }
}

/// Re-attaches a client session taken out with
/// [`SessionHandle::detach`](crate::SessionHandle::detach) — in this process
/// or, through its blob, in a new one (also after a reboot): restores it,
/// dials `addr` and resumes it (PROTOCOL §13). `offline` is how long the
/// continuation sat in storage; it counts towards the suspend timeout, as on
/// the server. Streams keep their ids: take them with
/// [`SessionHandle::stream`](crate::SessionHandle::stream).
///
/// Returns once the server accepted the resume. While the server cannot be
/// reached it keeps re-dialing with backoff, until the session expires.
/// Errors: [`Error::Restore`] for a blob that is not a client continuation of
/// this version; [`Error::Closed`] when the server refused the resume (it
/// no longer knows the session: expired, or lost with a crash) or the session
/// expired while re-dialing.
pub async fn resume(
    addr: &str,
    config: ClientConfig,
    detached: crate::Detached,
    offline: std::time::Duration,
) -> Result<SessionHandle, Error> {
    resume_journaled(addr, config, detached, offline, None).await
}

/// [`resume`], journaling the session from its first byte on (see
/// [`SessionHandle::set_journal`](crate::SessionHandle::set_journal)): the
/// resume itself already acknowledges what the server replays, so a journal
/// set only once `resume` returned could be behind what the server saw.
pub async fn resume_journaled(
    addr: &str,
    config: ClientConfig,
    detached: crate::Detached,
    offline: std::time::Duration,
    journal: Option<crate::JournalWriter>,
) -> Result<SessionHandle, Error> {
    let session = Session::restore_client(
        config.proto.clone(),
        Instant::now().into_std(),
        &detached.blob,
        offline,
    )
    .map_err(Error::Restore)?;
    let inner = Inner::new(session);
    {
        let mut sh = inner.lock();
        // It connected once: `connect`'s waiters and the driver treat the
        // session as established.
        sh.connected = true;
        let rare = sh.rare();
        rare.incoming.extend(detached.unaccepted);
        rare.orphans.extend(detached.orphans);
        rare.journal = journal.map(crate::journal::Journal::new);
        sh.tidy();
    }
    let mut events = inner.events.subscribe();
    let handle = SessionHandle::new(inner.clone());
    let driver = Driver::restored(
        inner.clone(),
        Kind::Client(Box::new(Dialer::new(addr.to_string(), config))),
    );
    tokio::spawn(driver.run::<crate::driver::AsClient>());
    loop {
        if let Some(reason) = inner.lock().closed.as_deref().cloned() {
            return Err(Error::Closed(reason));
        }
        match events.recv().await {
            Ok(crate::SessionEvent::Resumed { .. }) => return Ok(handle),
            Ok(crate::SessionEvent::Closed { reason }) => return Err(Error::Closed(reason)),
            Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
            Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                let reason = inner.lock().closed.as_deref().cloned();
                return Err(Error::Closed(reason.unwrap_or(
                    roam_proto::CloseReason::Local {
                        code: roam_proto::code::INTERNAL,
                    },
                )));
            }
        }
    }
}
