//! The way back: a resume names a session roam does not hold, roam asks the
//! host (`lookup`), the host checks and restores the continuation (`thaw`)
//! and, once roam installed it, makes it live and runs its routine
//! (`installed`).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

use roam::{Directory, Locating, Location, Restored, SessionHandle, SessionId};
use roam_proto::RestoreError;

use super::watcher::{watch_live, Start};
use super::{Frozen, HostInner, Slot, TRANSITION_WAIT};
use crate::compat;
use crate::error::DiscardReason;
use crate::record::{open_body, Body, Meta};
use crate::service::Service;
use crate::session::{Live, ManagedSession, Resumed};

/// The host as roam's [`Directory`]: where a session not live in roam is.
pub(crate) struct HostDirectory(pub(crate) Arc<HostInner>);

impl Directory for HostDirectory {
    fn locate(&self, id: SessionId) -> Locating {
        Box::pin(self.0.clone().lookup(id))
    }
}

impl HostInner {
    /// Reads and checks one stored continuation. `Err` names the failed check.
    pub(crate) async fn load(&self, id: SessionId) -> Result<Option<(Meta, Arc<Body>)>, String> {
        let store = self.store.clone();
        let raw = tokio::task::spawn_blocking(move || store.get(&id))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        let Some((meta, body)) = raw else {
            return Ok(None);
        };
        let meta = Meta::decode(&meta).map_err(|c| c.0.to_string())?;
        let body = body.ok_or_else(|| "body missing".to_string())?;
        let body = open_body(&meta, &body).map_err(|c| c.0.to_string())?;
        Ok(Some((meta, Arc::new(body))))
    }

    /// The server's lookup for a resume naming a session not in roam's
    /// routing map: a continuation here is restored, a session that moved
    /// is elsewhere, one in transition (freezing, thawing, moving, incoming)
    /// is waited for.
    pub(super) async fn lookup(self: Arc<Self>, id: SessionId) -> Location {
        let deadline = tokio::time::Instant::now() + TRANSITION_WAIT;
        let mut claimed = false;
        let frozen = loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let ask_shared = {
                let mut st = self.state();
                match st.slots.get(&id) {
                    None => {
                        match st.moved.get(&id) {
                            Some(t) if t.until > Instant::now() => {
                                return Location::Elsewhere(t.clients.clone())
                            }
                            Some(_) => {
                                st.moved.remove(&id);
                            }
                            None => {}
                        }
                        if self.shared.is_none() || claimed {
                            return Location::Unknown;
                        }
                        true
                    }
                    Some(Slot::Live(_)) => return Location::Unknown,
                    Some(Slot::Frozen(_)) => {
                        let Some(Slot::Frozen(f)) = st.slots.insert(id, Slot::Thawing) else {
                            unreachable!("matched above")
                        };
                        if let Some(t) = f.offload_at {
                            st.offloads.remove(&(t, id));
                        }
                        break f;
                    }
                    Some(Slot::Freezing | Slot::Thawing | Slot::Moving | Slot::Incoming(_)) => {
                        false
                    }
                }
            };
            if ask_shared {
                match self.clone().locate_shared(id).await {
                    Some(loc) => return loc,
                    // Claimed and installed as Frozen: thaw it.
                    None => {
                        claimed = true;
                        continue;
                    }
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Location::Refused(roam_proto::Error::ServerBusy);
            }
        };
        let result = self.thaw(id, frozen).await;
        self.changed.notify_waiters();
        result.into()
    }

    /// Asks the cluster's etcd about a session this host does not hold:
    /// `Some` answer for roam, or `None` when it was claimed here (its host
    /// died) and now waits in its slot, Frozen, for the thaw.
    async fn locate_shared(self: Arc<Self>, id: SessionId) -> Option<Location> {
        use crate::cluster::etcd::Found;
        let r = self.shared.as_ref()?;
        match r.locate(id).await {
            Ok(Found::Nothing) => Some(Location::Unknown),
            Ok(Found::Owned(host)) => {
                let addr = match self
                    .config
                    .cluster
                    .as_ref()
                    .and_then(|c| c.config.hosts.get(&host))
                {
                    Some(m) => m.clients.clone(),
                    None => match r.host_addr(&host).await {
                        Ok(Some(a)) => a,
                        _ => return Some(Location::Refused(roam_proto::Error::ServerBusy)),
                    },
                };
                Some(Location::Elsewhere(addr))
            }
            Ok(Found::Claimed(meta_bytes, stored)) => {
                let checked = Meta::decode(&meta_bytes)
                    .map_err(|c| c.0.to_string())
                    .and_then(|m| {
                        open_body(&m, &stored)
                            .map(|b| (m, b))
                            .map_err(|c| c.0.to_string())
                    });
                let (meta, body) = match checked {
                    Ok(x) => x,
                    Err(what) => {
                        self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
                        tracing::error!(
                            "session {id}: the continuation claimed from etcd is corrupt ({what})"
                        );
                        return Some(Location::Unknown);
                    }
                };
                // Ours now: kept here like any continuation until it thaws.
                let persisted = match self.store.put(id, meta_bytes, stored).await {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::error!("session {id}: claimed, kept in memory only: {e}");
                        false
                    }
                };
                self.counters.claimed.fetch_add(1, Ordering::Relaxed);
                let mut st = self.state();
                if st.slots.contains_key(&id) {
                    return Some(Location::Refused(roam_proto::Error::ServerBusy));
                }
                st.expiries.insert((meta.deadline, id));
                st.slots.insert(
                    id,
                    Slot::Frozen(Frozen {
                        meta,
                        hot: Some(Arc::new(body)),
                        offload_at: None,
                        persisted,
                        prepared: None,
                    }),
                );
                None
            }
            Err(e) => {
                tracing::warn!("session {id}: the cluster's etcd could not say where it is: {e}");
                Some(Location::Refused(roam_proto::Error::ServerBusy))
            }
        }
    }

    /// Puts a slot back to Frozen (refused resume).
    fn refreeze(&self, id: SessionId, meta: Meta, hot: Option<Arc<Body>>, persisted: bool) {
        let mut st = self.state();
        // Only a stored copy may leave memory.
        let offload_at = hot
            .as_ref()
            .filter(|_| persisted)
            .map(|_| Instant::now() + self.config.offload_after);
        if let Some(t) = offload_at {
            st.offloads.insert((t, id));
        }
        st.slots.insert(
            id,
            Slot::Frozen(Frozen {
                meta,
                hot,
                offload_at,
                persisted,
                prepared: None,
            }),
        );
        drop(st);
        self.gc_wake.notify_one();
    }

    async fn thaw(self: &Arc<Self>, id: SessionId, frozen: Frozen) -> roam::LookupResult {
        let Frozen {
            meta,
            hot,
            persisted,
            prepared,
            ..
        } = frozen;
        let body = match hot {
            Some(b) => b,
            None => match self.load(id).await {
                Ok(Some((_, b))) => b,
                Ok(None) => {
                    self.state().slots.remove(&id);
                    return Ok(None);
                }
                Err(what) => {
                    self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(
                        "session {id}: stored continuation is corrupt ({what}); quarantined"
                    );
                    if let Err(e) = self.store.quarantine(id.0.to_vec(), what.clone()).await {
                        tracing::error!("session {id}: quarantine failed: {e}");
                    }
                    self.refreeze(id, meta, None, persisted);
                    self.discard_frozen_slot(id, DiscardReason::Corrupt(what))
                        .await;
                    return Ok(None);
                }
            },
        };
        let now_wall = SystemTime::now();
        if now_wall >= meta.deadline {
            self.refreeze(id, meta, Some(body), persisted);
            self.discard_frozen_slot(id, DiscardReason::Expired).await;
            return Ok(None);
        }
        if let Err(inc) = compat::check(&self.services, &meta.service, &body) {
            self.counters.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("refused resume of session {id}: {inc}");
            if let Some(f) = &self.on_refused {
                f(id, &inc);
            }
            self.refreeze(id, meta, Some(body), persisted);
            // "Try again later": a compatible host (or version) may take it.
            return Err(roam_proto::Error::ServerBusy);
        }
        let svc = self.services[&meta.service].clone();
        let offline = now_wall.duration_since(meta.frozen_at).unwrap_or_default();
        let session = match roam_proto::Session::restore_server(
            &self.config.server.proto,
            Instant::now(),
            &body.blob,
            offline,
        ) {
            Ok(s) => s,
            Err(e) => {
                let reason = match e {
                    RestoreError::Expired => DiscardReason::Expired,
                    other => {
                        self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
                        tracing::error!(
                            "session {id}: protocol state refused ({other}); quarantined"
                        );
                        if let Err(e) = self
                            .store
                            .quarantine(id.0.to_vec(), other.to_string())
                            .await
                        {
                            tracing::error!("session {id}: quarantine failed: {e}");
                        }
                        DiscardReason::Restore(other)
                    }
                };
                self.refreeze(id, meta, Some(body), persisted);
                self.discard_frozen_slot(id, reason).await;
                return Ok(None);
            }
        };
        // A continuation is valid only as the latest state of its session
        // (PROTOCOL.md §13): delete it before the session moves on, so a
        // crash from here on can never restore a stale copy.
        if let Some(r) = self.shared.as_ref().filter(|_| persisted) {
            // The cluster's copy first, and only if still ours: a host that
            // claimed it after our lease lapsed has it now.
            match r.take(id).await {
                Ok(()) => {}
                Err(crate::cluster::etcd::SharedError::Lost(holder)) => {
                    tracing::warn!("session {id}: {holder} took it over; dropping our copy");
                    self.refreeze(id, meta, Some(body), persisted);
                    self.discard_frozen_slot(id, DiscardReason::Claimed(holder))
                        .await;
                    return Err(roam_proto::Error::ServerBusy);
                }
                Err(e) => {
                    tracing::error!("session {id}: not resumed, the cluster's etcd failed: {e}");
                    self.refreeze(id, meta, Some(body), persisted);
                    return Err(roam_proto::Error::ServerBusy);
                }
            }
        }
        if !persisted {
            // Moved in and served from memory: the store never had it.
        } else if let Err(e) = self.store.delete(vec![id]).await {
            tracing::error!("session {id}: could not delete its continuation before resuming: {e}");
            self.refreeze(id, meta, Some(body), persisted);
            return Err(roam_proto::Error::ServerBusy);
        }
        {
            let mut st = self.state();
            st.expiries.remove(&(meta.deadline, id));
        }
        let suspended_for = now_wall
            .duration_since(meta.suspended_at)
            .unwrap_or_default();
        let body = Arc::try_unwrap(body).unwrap_or_else(|b| (*b).clone());
        let unaccepted = body.unaccepted.clone();
        let orphans = body.orphans.clone();
        let guard = InstallGuard {
            host: Arc::downgrade(self),
            id,
            armed: true,
        };
        let host = self.clone();
        let parent = meta.parent;
        let revision = meta.revision;
        let on_installed = Box::new(move |handle: SessionHandle| {
            let mut guard = guard;
            guard.armed = false;
            host.installed(
                id,
                svc,
                body,
                (parent, revision),
                suspended_for,
                prepared,
                handle,
            );
        });
        Ok(Some(Restored::new(
            session,
            unaccepted,
            orphans,
            on_installed,
        )))
    }

    /// Discards a session whose slot is Frozen (after a failed thaw).
    async fn discard_frozen_slot(self: &Arc<Self>, id: SessionId, reason: DiscardReason) {
        self.discard_many(vec![(id, reason)]).await;
    }

    /// roam installed a restored session: make it live and run its routine.
    // The session's parts as they come out of its frozen slot; a struct
    // for them would only be unpacked again here.
    #[allow(clippy::too_many_arguments)]
    fn installed(
        self: &Arc<Self>,
        id: SessionId,
        svc: Arc<Service>,
        body: Body,
        (parent, revision): (Option<SessionId>, u64),
        suspended_for: Duration,
        prepared: Option<crate::service::Prepared>,
        handle: SessionHandle,
    ) {
        let events = handle.events();
        let live = Live::new(id, svc.clone(), body.attrs, handle.clone());
        {
            let mut st = live.lock();
            st.requires = body.requires;
            st.parent = parent;
            st.expiry = body.expiry;
            st.revision = revision;
        }
        self.state().slots.insert(id, Slot::Live(live.clone()));
        self.counters.resumes.fetch_add(1, Ordering::Relaxed);
        self.changed.notify_waiters();
        tokio::spawn(watch_live(
            Arc::downgrade(self),
            live.clone(),
            events,
            Start::Restoring,
        ));
        let mut streams = BTreeMap::new();
        for (name, sid) in body.streams {
            match handle.stream(sid) {
                Ok(s) => {
                    streams.insert(name, s);
                }
                Err(e) => tracing::warn!("session {id}: stream {name:?} ({sid}) is gone: {e}"),
            }
        }
        let resumed = Resumed {
            session: ManagedSession::new(live, self.clone(), handle),
            routine: body.routine,
            suspended_for,
            streams,
            prepared,
        };
        if let Some(f) = &svc.on_attach {
            f(&resumed);
        }
        let routine = svc.routines[&resumed.routine].clone();
        tokio::spawn(routine(resumed));
    }
}

/// Clears a Thawing slot if roam drops a restored session without
/// installing it (it lost a race to a copy already installed).
struct InstallGuard {
    host: Weak<HostInner>,
    id: SessionId,
    armed: bool,
}

impl Drop for InstallGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(h) = self.host.upgrade() {
            let mut st = h.state();
            if matches!(st.slots.get(&self.id), Some(Slot::Thawing)) {
                st.slots.remove(&self.id);
            }
            drop(st);
            h.changed.notify_waiters();
            tracing::error!("session {}: restored but never installed", self.id);
        }
    }
}
