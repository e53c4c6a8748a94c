//! The collector: one task per host, whatever the number of suspended
//! sessions.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

use roam::SessionId;
use tokio::sync::{watch, Notify};

use super::{HostInner, Slot, GC_MAX_SLEEP};
use crate::error::DiscardReason;

/// The collector: discards expired continuations and drops in-memory
/// copies that have been stored long enough. One task per host, whatever
/// the number of suspended sessions.
pub(super) async fn gc(host: Weak<HostInner>, wake: Arc<Notify>, mut stop: watch::Receiver<()>) {
    loop {
        let sleep = {
            let Some(h) = host.upgrade() else { return };
            let now_wall = SystemTime::now();
            let now = Instant::now();
            let (expired, next_expiry, next_offload) = {
                let mut st = h.state();
                let expired: Vec<SessionId> = st
                    .expiries
                    .iter()
                    .take_while(|(t, _)| *t <= now_wall)
                    .map(|(_, id)| *id)
                    .collect();
                while let Some(&(t, id)) = st.offloads.first() {
                    if t > now {
                        break;
                    }
                    st.offloads.pop_first();
                    if let Some(Slot::Frozen(f)) = st.slots.get_mut(&id) {
                        f.hot = None;
                        f.offload_at = None;
                        // Whatever a move-in started for it stops too: its
                        // routine starts afresh from the attributes.
                        f.prepared = None;
                    }
                }
                (
                    expired,
                    st.expiries
                        .iter()
                        .find(|(t, _)| *t > now_wall)
                        .map(|(t, _)| t.duration_since(now_wall).unwrap_or_default()),
                    st.offloads
                        .first()
                        .map(|(t, _)| t.saturating_duration_since(now)),
                )
            };
            h.discard_many(
                expired
                    .into_iter()
                    .map(|id| (id, DiscardReason::Expired))
                    .collect(),
            )
            .await;
            let mut sleep = GC_MAX_SLEEP;
            for d in [next_expiry, next_offload].into_iter().flatten() {
                sleep = sleep.min(d);
            }
            sleep
        };
        tokio::select! {
            () = tokio::time::sleep(sleep + Duration::from_millis(1)) => {}
            () = wake.notified() => {}
            r = stop.changed() => if r.is_err() { return },
        }
    }
}
