//! Errors, kept in families: configuration and API misuse ([`Error`],
//! [`SuspendError`]), incompatible hosts ([`Incompatible`]), and what
//! happened to a continuation that will never resume ([`DiscardReason`]).

use std::fmt;

use roam_proto::{ExportError, RestoreError, SessionId};

use crate::store::StoreError;

/// Setting up or using a [`Host`](crate::Host) failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The continuation store could not be opened or written.
    Store(StoreError),
    /// No service of that name is registered on this host.
    UnknownService(String),
    /// Two services were registered under one name.
    DuplicateService(String),
    /// A name (service, routine) is empty or longer than 255 bytes.
    BadName(String),
    /// The host holds no session with that id (live or suspended).
    UnknownSession(SessionId),
    /// The session has no id yet (its first handshake is not complete).
    NotEstablished,
    /// A dependency would make a session depend on itself, directly or not.
    DependencyCycle(SessionId),
    /// The stored continuation failed a check (the text names it).
    Corrupt(String),
    /// The continuation cannot run on this host.
    Incompatible(Incompatible),
    /// The cluster's shared directory (etcd) could not be reached or used.
    Shared(crate::cluster::etcd::SharedError),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Store(e) => write!(f, "{e}"),
            Self::UnknownService(s) => {
                write!(f, "no service {s:?} is registered on this host")
            }
            Self::DuplicateService(s) => write!(f, "service {s:?} registered twice"),
            Self::BadName(s) => write!(f, "name {s:?} must be 1 to 255 bytes"),
            Self::UnknownSession(id) => write!(f, "this host holds no session {id}"),
            Self::Shared(e) => write!(f, "cluster directory: {e}"),
            Self::NotEstablished => write!(f, "session not established yet"),
            Self::DependencyCycle(id) => {
                write!(f, "depending on session {id} would create a cycle")
            }
            Self::Corrupt(what) => write!(f, "stored continuation is corrupt: {what}"),
            Self::Incompatible(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Store(e) => Some(e),
            Self::Incompatible(e) => Some(e),
            _ => None,
        }
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

/// [`ManagedSession::suspend`](crate::ManagedSession::suspend) failed; the
/// session was not suspended (it goes on, or it had already ended).
#[derive(Debug)]
#[non_exhaustive]
pub enum SuspendError {
    /// The continuation names a routine the service does not register.
    UnknownRoutine {
        /// The service.
        service: String,
        /// The routine named.
        routine: String,
    },
    /// The session could not be exported (not established, or closed).
    Export(ExportError),
    /// The session is already being suspended or was suspended.
    AlreadySuspended,
}

impl fmt::Display for SuspendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownRoutine { service, routine } => write!(
                f,
                "service {service:?} has no routine {routine:?}; register it with Service::routine"
            ),
            Self::Export(e) => write!(f, "cannot suspend: {e}"),
            Self::AlreadySuspended => write!(f, "session is already suspended"),
        }
    }
}

impl std::error::Error for SuspendError {}

/// A stored continuation cannot run on this host: the error names what it
/// requires and what the host has. The continuation is kept until it
/// expires (a compatible host may still take it); the client is told to
/// retry later.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Incompatible {
    /// Its service is not registered here.
    UnknownService(String),
    /// Its resume routine is not registered by the service here.
    UnknownRoutine {
        /// The service.
        service: String,
        /// The routine the continuation names.
        routine: String,
    },
    /// A required property is missing or has another value.
    Mismatch {
        /// The service.
        service: String,
        /// The property.
        property: String,
        /// The value the continuation requires.
        required: String,
        /// This host's value, if it has the property at all.
        found: Option<String>,
    },
}

impl fmt::Display for Incompatible {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownService(s) => write!(
                f,
                "continuation belongs to service {s:?}, which this host does not run"
            ),
            Self::UnknownRoutine { service, routine } => write!(
                f,
                "continuation resumes with routine {routine:?}, which service {service:?} on this host does not register"
            ),
            Self::Mismatch {
                service,
                property,
                required,
                found: Some(v),
            } => write!(
                f,
                "continuation requires {property} = {required:?} but service {service:?} on this host has {property} = {v:?}"
            ),
            Self::Mismatch {
                service,
                property,
                required,
                found: None,
            } => write!(
                f,
                "continuation requires {property} = {required:?} but service {service:?} on this host does not register {property}"
            ),
        }
    }
}

impl std::error::Error for Incompatible {}

/// Why a continuation was dropped for good.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DiscardReason {
    /// It stayed suspended past its expiry.
    Expired,
    /// The session it depends on was discarded or closed.
    ParentGone(SessionId),
    /// Its stored entry failed a check; the text names which. The entry is
    /// kept in the store's quarantine table.
    Corrupt(String),
    /// The protocol refused to restore it.
    Restore(RestoreError),
    /// The application or operator asked for it ([`Host::discard`](crate::Host::discard)).
    Requested,
    /// Another host of the cluster took it over (this host's etcd lease
    /// lapsed and that host claimed it); the text names the host.
    Claimed(String),
}

impl fmt::Display for DiscardReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Expired => write!(f, "expired"),
            Self::ParentGone(p) => write!(f, "the session it depends on ({p}) is gone"),
            Self::Corrupt(what) => write!(f, "stored continuation is corrupt ({what})"),
            Self::Restore(e) => write!(f, "{e}"),
            Self::Requested => write!(f, "discarded on request"),
            Self::Claimed(h) => write!(f, "taken over by {h}"),
        }
    }
}
