//! Hooks for session continuations (`docs/PROTOCOL.md` §13) used by the
//! `roam-continuation` crate: taking a session out of its driver
//! ([`SessionHandle::detach`](crate::SessionHandle::detach)), and the
//! [`Directory`] a server asks where a session it does not hold lives —
//! stored here as a continuation (then put back into the routing map), on
//! another host of the service (then the client is redirected there, §9.3),
//! or nowhere ([`serve_with_directory`](crate::serve_with_directory)).
//!
//! Nothing here decides *when* to detach or where a continuation is kept;
//! that is the caller's policy.

use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use roam_proto::{SessionId, StreamId};
use tokio::sync::mpsc;

use crate::SessionHandle;

/// A session taken out of its driver: no task, socket or buffer of roam holds
/// it any more. Restore `blob` with `roam_proto::Session::restore_server` and
/// hand it back as a [`Restored`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Detached {
    /// The continuation: the session's complete protocol state (§13). Holds
    /// the resume secret: store it where only its owner can read it.
    pub blob: Vec<u8>,
    /// Streams the peer opened that the application had not accepted yet;
    /// they are offered to `accept_stream` again after a restore.
    pub unaccepted: Vec<StreamId>,
    /// Streams whose handles had been dropped before their end: incoming data
    /// on them keeps being discarded after a restore.
    pub orphans: Vec<StreamId>,
}

impl Detached {
    /// A continuation with its stream lists, as [`SessionHandle::detach`]
    /// made it (e.g. after it travelled to another process).
    pub fn new(blob: Vec<u8>, unaccepted: Vec<StreamId>, orphans: Vec<StreamId>) -> Self {
        Self {
            blob,
            unaccepted,
            orphans,
        }
    }
}

/// A session's live connection, taken out with it
/// ([`SessionHandle::detach_live`](crate::SessionHandle::detach_live)) to
/// go on in another process: a relay takeover hands it over with the
/// continuation, and the new process continues the same connection (an
/// [`Adoption`]) instead of waiting for the peer to resume
/// (`docs/PROTOCOL.md` §13.6).
#[derive(Debug)]
#[non_exhaustive]
pub struct LiveTransport {
    /// The connected socket (TCP or Unix-domain).
    pub fd: OwnedFd,
    /// The peer's address, as the session knew it.
    pub peer: SocketAddr,
    /// The transport state (`roam_proto::Session::export_transport`). Holds
    /// the connection's traffic keys: it travels as the continuation does
    /// and is never stored.
    pub state: Vec<u8>,
    /// Records already sealed and not yet written to the socket: they go
    /// out first, before anything the new process seals.
    pub unsent: Vec<u8>,
}

impl LiveTransport {
    /// A live transport as [`SessionHandle::detach_live`](crate::SessionHandle::detach_live)
    /// made it (e.g. after it travelled to another process).
    pub fn new(fd: OwnedFd, peer: SocketAddr, state: Vec<u8>, unsent: Vec<u8>) -> Self {
        Self {
            fd,
            peer,
            state,
            unsent,
        }
    }
}

/// A restored session to install in a running server together with its
/// live connection (see [`LiveTransport`]).
#[derive(Debug)]
pub struct Adoption {
    /// The session, restored from the continuation taken with `live`.
    pub restored: Restored,
    /// Its connection.
    pub live: LiveTransport,
}

/// Hands [`Adoption`]s to the server whose [`ServerConfig::adoptions`](crate::ServerConfig::adoptions)
/// holds the other end ([`adoption_queue`]).
#[derive(Debug, Clone)]
pub struct Adopter(mpsc::UnboundedSender<Adoption>);

impl Adopter {
    /// Queues `a` for installation: the server puts the session in its
    /// routing map and runs it on its connection at once (or, if the
    /// connection or its state is refused, drops the connection and
    /// installs the session suspended, so the peer resumes). Gives `a`
    /// back when the server has stopped.
    pub fn adopt(&self, a: Adoption) -> Result<(), Box<Adoption>> {
        self.0.send(a).map_err(|e| Box::new(e.0))
    }
}

/// The server's end of an [`adoption_queue`]; put it in
/// [`ServerConfig::adoptions`](crate::ServerConfig::adoptions). One server
/// takes the queue; clones share it.
#[derive(Debug, Clone)]
pub struct Adoptions(Arc<Mutex<Option<mpsc::UnboundedReceiver<Adoption>>>>);

impl Adoptions {
    /// The receiver, for the server that starts with it (once).
    pub(crate) fn take(&self) -> Option<mpsc::UnboundedReceiver<Adoption>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// A queue of sessions to adopt with their connections: the [`Adopter`]
/// sends, the server whose config holds the [`Adoptions`] installs.
/// Adoptions sent before the server starts wait for it.
pub fn adoption_queue() -> (Adopter, Adoptions) {
    let (tx, rx) = mpsc::unbounded_channel();
    (Adopter(tx), Adoptions(Arc::new(Mutex::new(Some(rx)))))
}

/// Called with the handle of a restored session once it is in the routing map,
/// before its driver runs (so an event subscription made here misses nothing).
pub type OnInstalled = Box<dyn FnOnce(SessionHandle) + Send>;

/// A restored session to install in a running server.
#[non_exhaustive]
pub struct Restored {
    /// The restored protocol session (suspended; waiting for the resume).
    pub session: roam_proto::Session,
    /// From [`Detached::unaccepted`].
    pub unaccepted: Vec<StreamId>,
    /// From [`Detached::orphans`].
    pub orphans: Vec<StreamId>,
    /// Receives the new handle.
    pub on_installed: OnInstalled,
}

impl Restored {
    /// A restored session with the stream lists of its [`Detached`] and the
    /// callback that receives its handle.
    pub fn new(
        session: roam_proto::Session,
        unaccepted: Vec<StreamId>,
        orphans: Vec<StreamId>,
        on_installed: OnInstalled,
    ) -> Self {
        Self {
            session,
            unaccepted,
            orphans,
            on_installed,
        }
    }
}

impl std::fmt::Debug for Restored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Restored")
            .field("session", &self.session.id())
            .field("unaccepted", &self.unaccepted)
            .field("orphans", &self.orphans)
            .finish_non_exhaustive()
    }
}

/// What a lookup answers for a resume naming a session the server does not
/// hold: `Ok(Some(_))` installs it, `Ok(None)` means unknown here (the
/// routing map is checked once more, then the resume is refused as
/// `UnknownSession`), `Err(e)` refuses the resume with `e`'s status (e.g.
/// `ServerBusy` for "try again later"). The closure form of a [`Directory`]
/// that knows no other host ([`serve_with_restore`](crate::serve_with_restore)).
pub type LookupResult = Result<Option<Restored>, roam_proto::Error>;

/// Where a session that is not live in this server lives, as a
/// [`Directory`] answers.
#[non_exhaustive]
pub enum Location {
    /// Here, as a stored continuation: install it and resume on it.
    /// (Boxed: a restored session is large, the other answers are small.)
    Stored(Box<Restored>),
    /// On another host of the service, reachable for clients at this
    /// `host:port`: the resume is answered with a `Moved` refusal naming it
    /// (`docs/PROTOCOL.md` §9.3) and the client resumes there.
    Elsewhere(String),
    /// Nowhere this directory knows: the resume is refused `UnknownSession`.
    Unknown,
    /// Refuse this resume with the error's status, e.g. `ServerBusy` for
    /// "try again later" (a session that is being moved or restored).
    Refused(roam_proto::Error),
}

impl std::fmt::Debug for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Stored(r) => f.debug_tuple("Stored").field(r).finish(),
            Self::Elsewhere(a) => f.debug_tuple("Elsewhere").field(a).finish(),
            Self::Unknown => f.write_str("Unknown"),
            Self::Refused(e) => f.debug_tuple("Refused").field(e).finish(),
        }
    }
}

impl From<LookupResult> for Location {
    fn from(r: LookupResult) -> Self {
        match r {
            Ok(Some(restored)) => Self::Stored(Box::new(restored)),
            Ok(None) => Self::Unknown,
            Err(e) => Self::Refused(e),
        }
    }
}

/// A boxed future a [`Directory`] answers with.
pub type Locating = Pin<Box<dyn Future<Output = Location> + Send>>;

/// Where sessions live when they are not live in this server's routing map:
/// the seam between one server and the rest of its service (continuation
/// stores, other hosts of a cluster). A server asks it once per resume that
/// names a session it does not hold; the answer must not wait long (the
/// client is waiting), but may wait for a move in progress to settle.
pub trait Directory: Send + Sync + 'static {
    /// Where session `id` lives.
    fn locate(&self, id: SessionId) -> Locating;
}

/// A [`Directory`] from a lookup closure (stored continuations only).
pub(crate) struct LookupDirectory<L>(pub(crate) L);

impl<L, Fut> Directory for LookupDirectory<L>
where
    L: Fn(SessionId) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = LookupResult> + Send + 'static,
{
    fn locate(&self, id: SessionId) -> Locating {
        let fut = (self.0)(id);
        Box::pin(async move { Location::from(fut.await) })
    }
}

/// The directory of a server that keeps nothing outside its routing map.
pub(crate) struct NoDirectory;

impl Directory for NoDirectory {
    fn locate(&self, _id: SessionId) -> Locating {
        Box::pin(std::future::ready(Location::Unknown))
    }
}
