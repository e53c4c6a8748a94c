//! The server's side of a driver: resumes handed over by the accept loop,
//! the per-key session cap, shutdown, and leaving the routing map.
//!
//! The accept loop (`crate::server`) owns the routing map; the driver sees
//! it only through [`Routing`], so this module does not depend on the
//! server and the server depends on the driver alone.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::transport::{network_peer, Transport};
use roam_proto::{Hello, PublicKey, SessionId};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit};

use super::conn::Conn;
use super::id_text;
use crate::handle::{SessionHandle, Shared};

/// The routing map as a driver sees it: where its session is registered
/// for resumes.
pub(crate) trait Routing: Send + Sync {
    /// Takes session `id` out of the map: later resumes of it no longer
    /// reach this driver.
    fn remove(&self, id: &SessionId);
}

/// A resume transport handed from the accept loop to the session it names.
pub(crate) struct Handoff {
    pub(crate) sock: Transport,
    pub(crate) hello: Hello,
    /// Bytes read after the hello.
    pub(crate) rest: Vec<u8>,
    pub(crate) peer: SocketAddr,
    pub(crate) permit: OwnedSemaphorePermit,
}

/// Throttles warnings about clients refused after their handshake (unknown
/// key, too many sessions for the key): one line per 10 s, with a count.
static REFUSALS: crate::limits::SharedThrottle =
    crate::limits::SharedThrottle::new(Duration::from_secs(10));

/// Callback receiving each new server session once its handshake completes.
pub(crate) type OnSession = Arc<dyn Fn(SessionHandle) + Send + Sync>;

/// Server side: resumes arriving for this session, and shutdown.
pub(crate) struct ServerSide {
    pub(crate) id: SessionId,
    pub(crate) handoffs: mpsc::Receiver<Box<Handoff>>,
    /// The routing map this session is registered in.
    pub(crate) registry: Arc<dyn Routing>,
    pub(crate) on_session: OnSession,
    pub(crate) shutdown: watch::Receiver<bool>,
    pub(crate) shutdown_grace: Duration,
    /// Dropped when the driver ends: the server waits for all of these.
    pub(crate) _running: mpsc::Sender<()>,
    /// This session's place in the server's per-IP and per-key counts;
    /// released when the driver ends.
    pub(crate) slot: crate::limits::SessionSlot,
    /// Sessions one client key may hold (`ServerConfig::max_sessions_per_key`).
    pub(crate) max_sessions_per_key: usize,
}

impl ServerSide {
    /// Takes this session out of the routing map.
    pub(super) fn unroute(&self) {
        self.registry.remove(&self.id);
    }

    /// A resume arrived for this session: accepts it on a new connection or
    /// answers the refusal.
    pub(super) fn on_handoff(
        &mut self,
        sh: &mut Shared,
        h: Handoff,
        now: std::time::Instant,
    ) -> Option<Conn> {
        match sh
            .session
            .accept_resume(now, &h.hello, network_peer(h.peer))
        {
            Ok(tid) => {
                crate::sockopt::configure(&h.sock, Duration::from_secs(30));
                let conn = Conn::new(tid, h.sock, h.peer, Some(h.permit));
                if !h.rest.is_empty() {
                    if let Err(e) = sh.session.handle_input(now, tid, &h.rest) {
                        tracing::debug!("resume from {}: {e}", h.peer);
                    }
                }
                Some(conn)
            }
            Err(e) => {
                tracing::info!(
                    "refused resume of session {} from {}: {e}",
                    id_text(sh),
                    h.peer
                );
                tokio::spawn(reject(h.sock, h.hello, e));
                None
            }
        }
    }

    /// The session was refused: its client key is not authorized.
    pub(super) fn note_unauthorized(&self) {
        self.slot.note_unauthorized();
    }

    /// The session's first handshake completed with `peer_key`: counts it
    /// against the per-key cap, or closes the session (busy) if the key
    /// already holds its share. Returns whether the session may go on.
    pub(super) fn admit_key(
        &mut self,
        sh: &mut Shared,
        session_id: SessionId,
        peer_key: PublicKey,
    ) -> bool {
        let Err(held) = self.slot.set_key(peer_key, self.max_sessions_per_key) else {
            return true;
        };
        let peer = sh.session.peer_addr();
        if let Some(n) = REFUSALS.allow() {
            tracing::warn!(
                "refused new session {session_id} from {} with client key {peer_key}: the key already holds {held} sessions, its limit{}",
                peer.map_or_else(|| "?".to_string(), |p| p.to_string()),
                crate::limits::suppressed_note(n)
            );
        }
        sh.session.close(
            roam_proto::code::SERVER_BUSY,
            &format!("server busy: this client key already holds {held} sessions, the server's limit; close some or try again later"),
        );
        false
    }
}

/// Logs (throttled) a client refused because its key is not authorized.
pub(super) fn warn_unauthorized(sh: &Shared) {
    if let Some(n) = REFUSALS.allow() {
        tracing::warn!(
            "refused client {} with key {}: not in the authorized keys{}",
            sh.session
                .peer_addr()
                .map_or_else(|| "?".to_string(), |p| p.to_string()),
            sh.session
                .peer_key()
                .map_or_else(|| "?".to_string(), |k| k.to_string()),
            crate::limits::suppressed_note(n)
        );
    }
}

/// Answers a refused transport with its status and closes it.
pub(crate) async fn reject(mut sock: Transport, hello: Hello, err: roam_proto::Error) {
    let mut out = Vec::new();
    hello.reject(err.refusal_status(), &mut out);
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = sock.write_all(&out).await;
        let _ = sock.shutdown().await;
    })
    .await;
}
