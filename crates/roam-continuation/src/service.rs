//! Services: what an application registers once per kind of session — its
//! compatibility properties, resume routines, default expiry and generation
//! policy, and its attach and discard handlers (the paper's
//! `register_compat_vector` and `register_attach_handler`).

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::session::Resumed;
use crate::Discarded;

/// When a session's application produces its continuation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Generation {
    /// As soon as the session is suspended (its transport lost): the session
    /// holds no task, socket or buffer from then on.
    Eager,
    /// The application keeps running through the disconnection; roam asks
    /// for the continuation (`freeze`) once the session has been suspended
    /// for `after`, or earlier when it must reclaim resources (a parent
    /// froze, shutdown, [`Host::freeze`](crate::Host::freeze)).
    Lazy {
        /// How long a session may stay suspended with its task and buffers.
        after: Duration,
    },
}

/// A resume routine: gets the restored session and must carry it on.
pub(crate) type Routine =
    Arc<dyn Fn(Resumed) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;
pub(crate) type AttachHandler = Arc<dyn Fn(&Resumed) + Send + Sync>;
pub(crate) type DiscardHandler = Arc<dyn Fn(&Discarded) + Send + Sync>;
pub(crate) type MoveInCheck =
    Arc<dyn Fn(&BTreeMap<String, Vec<u8>>) -> Result<(), String> + Send + Sync>;
pub(crate) type MoveInPrepare = Arc<
    dyn Fn(
            &BTreeMap<String, Vec<u8>>,
        ) -> Pin<Box<dyn Future<Output = Result<Option<Prepared>, String>> + Send>>
        + Send
        + Sync,
>;

/// What a service's [`prepare_move_in`](Service::prepare_move_in) started
/// for a session moving in: kept with the session from the check to its
/// resume ([`Resumed::take_prepared`](crate::Resumed::take_prepared)), and
/// dropped (which must stop whatever it started) if the move is called off
/// or the session does not resume with it.
pub(crate) struct Prepared(pub(crate) Box<dyn Any + Send>);

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Prepared(..)")
    }
}

/// Default time a suspended session is kept: one day.
pub const DEFAULT_EXPIRY: Duration = Duration::from_secs(24 * 3600);

/// One kind of session a host serves (the paper's service id). Build it and
/// pass it to [`HostBuilder::service`](crate::HostBuilder::service).
///
/// ```
/// use std::time::Duration;
/// use roam_continuation::{Generation, Service};
///
/// let svc = Service::new("bench")
///     .version("1")
///     .property("codec", "u64-le")
///     .expiry(Duration::from_secs(3600))
///     .generation(Generation::Eager)
///     .routine("updates", |mut resumed| async move {
///         let next = resumed.session.retrieve("next");
///         let stream = resumed.take_stream("updates");
///         // ... carry on sending from `next` on `stream`
///         # let _ = (next, stream);
///     })
///     .on_discard(|d| println!("session {} discarded: {}", d.id, d.reason));
/// # let _ = svc;
/// ```
///
/// Cloning is cheap (handlers and routines are shared).
#[derive(Clone)]
pub struct Service {
    pub(crate) name: String,
    pub(crate) properties: BTreeMap<String, String>,
    pub(crate) expiry: Duration,
    pub(crate) generation: Generation,
    pub(crate) routines: HashMap<String, Routine>,
    pub(crate) on_attach: Option<AttachHandler>,
    pub(crate) on_discard: Option<DiscardHandler>,
    pub(crate) on_move_in: Option<MoveInCheck>,
    pub(crate) prepare_move_in: Option<MoveInPrepare>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut routines: Vec<&String> = self.routines.keys().collect();
        routines.sort();
        f.debug_struct("Service")
            .field("name", &self.name)
            .field("properties", &self.properties)
            .field("expiry", &self.expiry)
            .field("generation", &self.generation)
            .field("routines", &routines)
            .finish_non_exhaustive()
    }
}

impl Service {
    /// A service called `name` (at most 255 bytes), eager, kept for
    /// [`DEFAULT_EXPIRY`], with no properties or routines yet.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            properties: BTreeMap::new(),
            expiry: DEFAULT_EXPIRY,
            generation: Generation::Eager,
            routines: HashMap::new(),
            on_attach: None,
            on_discard: None,
            on_move_in: None,
            prepare_move_in: None,
        }
    }

    /// Registers a compatibility property of this host's service (the
    /// paper's `register_compat_vector`). A continuation that
    /// [requires](crate::ManagedSession::require) a property resumes only
    /// where the service has it with the same value.
    pub fn property(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.insert(name.into(), value.into());
        self
    }

    /// Shorthand for `property("version", v)`. Every continuation of the
    /// service requires the version it was suspended under.
    pub fn version(self, v: impl Into<String>) -> Self {
        self.property("version", v)
    }

    /// How long a suspended session is kept before it is discarded (default
    /// one day; a session can override it). Also bounded by the protocol's
    /// resume timeout.
    pub fn expiry(mut self, d: Duration) -> Self {
        self.expiry = d;
        self
    }

    /// Eager or lazy generation for this service's sessions (default eager).
    pub fn generation(mut self, g: Generation) -> Self {
        self.generation = g;
        self
    }

    /// Registers the resume routine `name` (at most 255 bytes). A
    /// continuation names the routine to run when its session resumes; roam
    /// spawns it with the restored session.
    pub fn routine<F, Fut>(mut self, name: impl Into<String>, f: F) -> Self
    where
        F: Fn(Resumed) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let r: Routine = Arc::new(move |res| Box::pin(f(res)));
        self.routines.insert(name.into(), r);
        self
    }

    /// Called for every resumed session of this service before its routine
    /// runs (the paper's attach handler, e.g. to count or index sessions).
    /// Keep it short: it runs on the accepting task.
    pub fn on_attach(mut self, f: impl Fn(&Resumed) + Send + Sync + 'static) -> Self {
        self.on_attach = Some(Arc::new(f));
        self
    }

    /// Called when one of this service's suspended sessions is discarded
    /// (expired, its parent went away, or its stored continuation was
    /// corrupt), with its last attributes when they could be read.
    pub fn on_discard(mut self, f: impl Fn(&Discarded) + Send + Sync + 'static) -> Self {
        self.on_discard = Some(Arc::new(f));
        self
    }

    /// Checks a session moving in from another host of the cluster, at
    /// the destination, before the move commits: `f` gets the session's
    /// attributes (pre-copied and transferred) and may refuse with a
    /// reason. A refusal calls the move off (`MoveError::Refused`) and the
    /// session stays at its source, where its continuation resumes. It
    /// runs under the host's state lock: keep it short, and do not call
    /// the host from it. A service set's cut is checked
    /// with [`check_cut`](crate::service_set::check_cut), the cut and the
    /// back-end program it restarts together with
    /// [`check_move_in`](crate::service_set::check_move_in).
    pub fn on_move_in(
        mut self,
        f: impl Fn(&BTreeMap<String, Vec<u8>>) -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.on_move_in = Some(Arc::new(f));
        self
    }

    /// Prepares a session moving in from another host of the cluster, at
    /// the destination, before the move commits and after
    /// [`on_move_in`](Self::on_move_in) passed: `f` gets the session's
    /// attributes and returns a future (not holding them) that starts what
    /// the session needs here — e.g. a service set's back-end processes
    /// restarted from their parts and frozen
    /// ([`Staged`](crate::service_set::Staged)) — and gives it back, or
    /// refuses with a reason. A refusal, or no answer within 5 s, calls the
    /// move off (`MoveError::Refused`) and the session stays at its source.
    ///
    /// What it gives back stays with the session: its resume routine takes
    /// it with [`Resumed::take_prepared`](crate::Resumed::take_prepared).
    /// If the move is called off after all, the session moves on again or
    /// is offloaded before its client resumes, or its resume fails, the
    /// value is dropped; its drop must stop what it started (a
    /// `tokio::process::Child` with `kill_on_drop`, closed control sockets),
    /// and the routine must cope with its absence (start afresh from the
    /// attributes). `f` itself runs under the host's state lock: keep it to
    /// reading the attributes.
    pub fn prepare_move_in<F, Fut, T>(mut self, f: F) -> Self
    where
        F: Fn(&BTreeMap<String, Vec<u8>>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Option<T>, String>> + Send + 'static,
        T: Send + 'static,
    {
        let p: MoveInPrepare = Arc::new(move |attrs| {
            let fut = f(attrs);
            Box::pin(async move {
                fut.await
                    .map(|v| v.map(|v| Prepared(Box::new(v) as Box<dyn Any + Send>)))
            })
        });
        self.prepare_move_in = Some(p);
        self
    }

    /// The service's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}
