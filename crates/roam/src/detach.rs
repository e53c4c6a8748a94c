//! Hooks for session continuations (`docs/PROTOCOL.md` §13) used by the
//! `roam-continuation` crate: taking a session out of its driver
//! ([`SessionHandle::detach`](crate::SessionHandle::detach)) and putting a
//! restored one back into a server's routing map
//! ([`serve_with_restore`](crate::serve_with_restore)).
//!
//! Nothing here decides *when* to detach or where a continuation is kept;
//! that is the caller's policy.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

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
/// `ServerBusy` for "try again later").
pub type LookupResult = Result<Option<Restored>, roam_proto::Error>;

/// The boxed lookup a server calls on a routing-map miss.
pub(crate) type Lookup =
    Arc<dyn Fn(SessionId) -> Pin<Box<dyn Future<Output = LookupResult> + Send>> + Send + Sync>;
