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
use std::pin::Pin;

use roam_proto::{SessionId, StreamId};

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
