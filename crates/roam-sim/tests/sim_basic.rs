//! Smoke tests of the simulator itself and the happy path.

use std::time::Duration;

use roam_proto::{Event, State};
use roam_sim::net::{Sim, SimConfig};
use roam_sim::workload::Workload;

#[test]
fn clean_transfer_completes() {
    let mut sim = Sim::new(SimConfig::new(1));
    sim.dial();
    let mut w = Workload::start(&mut sim, 4, 300_000);
    let deadline = sim.now + Duration::from_secs(60);
    let ok = sim.run_until(deadline, |s| w.pump(s));
    assert!(w.error.is_none(), "{:?}", w.error);
    assert!(
        ok,
        "not done: client {:?} server {:?}",
        sim.client, sim.server
    );
    assert_eq!(sim.client.state(), State::Active);
    assert!(sim
        .client_events
        .iter()
        .any(|e| matches!(e, Event::Connected { .. })));
    assert_eq!(w.verified_bytes(), 2 * 4 * 300_000);
}
