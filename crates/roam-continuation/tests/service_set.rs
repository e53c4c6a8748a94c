//! A service set of three real processes (`examples/service_member.rs`:
//! producer → forwarder → consumer over Unix sockets) moved between two
//! sites while records flow, by a coordinator that freezes the set, takes
//! each member's part, checks the whole cut, starts the destination's
//! processes from their restarted parts, ends the source's and thaws the
//! destination. Half the records are written in nondeterministic intervals
//! (random payloads per process), so a replayed interval writes other bytes.
//!
//! What a user of a multi-process service cares about: at the end the
//! consumer holds exactly the producer's records, in order, none lost,
//! none twice, none from a replay that was discarded; a destination that
//! dies mid-move leaves the set running at the source; a log over its cap
//! refuses the move with the reason and loses nothing.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rand::Rng;
use roam_continuation::service_set::{move_set, Control, MoveOutcome};
use roam_service::Limits;
use tokio::net::UnixListener;
use tokio::process::{Child, Command};

const ROLES: [&str; 3] = ["w", "f", "r"];
const RECORDS: u64 = 4000;

/// One site's running set: its processes and their control sockets, in
/// the service set's order.
struct Running {
    children: Vec<Child>,
    controls: Vec<Control>,
    site: usize,
}

/// What the coordinator needs to start members.
struct Coordinator {
    listener: UnixListener,
    control_path: PathBuf,
    sites: [PathBuf; 2],
    out: PathBuf,
    log_cap: Option<usize>,
    /// `unix`, `tcp` or `fifo`: what the channels run on.
    transport: &'static str,
    /// Starts so far: each start sets up its channels in a directory of
    /// its own under its site's, so nothing of an earlier incarnation
    /// (a socket, a FIFO, a published port) is found by a later one.
    starts: std::sync::atomic::AtomicUsize,
}

impl Coordinator {
    fn new(dir: &Path, log_cap: Option<usize>, transport: &'static str) -> Self {
        let control_path = dir.join("control.sock");
        let sites = [dir.join("site-a"), dir.join("site-b")];
        for s in &sites {
            std::fs::create_dir_all(s).unwrap();
        }
        let out = dir.join("out");
        std::fs::create_dir_all(&out).unwrap();
        Coordinator {
            listener: UnixListener::bind(&control_path).unwrap(),
            control_path,
            sites,
            out,
            log_cap,
            transport,
            starts: Default::default(),
        }
    }

    /// Starts the three members at `site`, fresh or from restarted parts;
    /// `sabotage` kills the forwarder once it has joined (a destination
    /// that dies mid-move).
    async fn start(
        &self,
        site: usize,
        parts: Option<&[Vec<u8>]>,
        sabotage: bool,
    ) -> std::io::Result<Running> {
        let n = self
            .starts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let channels = self.sites[site].join(n.to_string());
        std::fs::create_dir_all(&channels)?;
        let mut children = Vec::new();
        for role in ROLES {
            let mut cmd = Command::new(common::example("service_member"));
            cmd.arg(role)
                .arg(&channels)
                .arg(&self.control_path)
                .arg(&self.out)
                .arg(RECORDS.to_string())
                .kill_on_drop(true);
            cmd.arg(self.log_cap.unwrap_or(0).to_string())
                .arg(self.transport);
            children.push(cmd.spawn()?);
        }
        let controls = common::join_members(
            &self.listener,
            &ROLES,
            parts,
            &mut children,
            sabotage.then_some(1),
        )
        .await?;
        Ok(Running {
            children,
            controls,
            site,
        })
    }
}

/// How a run's moves went.
#[derive(Debug, Default)]
struct Moves {
    done: u32,
    refused: Vec<String>,
    destination_failed: u32,
    /// Each completed move's time from the freeze to the thaw at the
    /// destination (ms), and the size of its encoded parts (bytes).
    times: Vec<(u128, usize)>,
}

/// Runs the set from a fresh start, moves it `moves` times (the move whose
/// index is `sabotage_at` gets a destination that dies), waits for the
/// consumer, and checks exactly-once.
async fn run(
    log_cap: Option<usize>,
    moves: u32,
    sabotage_at: Option<u32>,
    transport: &'static str,
) -> Moves {
    let dir = tempfile::tempdir().unwrap();
    let co = Coordinator::new(dir.path(), log_cap, transport);
    let limits = Limits {
        log_bytes: log_cap.unwrap_or(Limits::default().log_bytes),
        ..Limits::default()
    };
    let mut set = co.start(0, None, false).await.expect("fresh start");
    let mut report = Moves::default();
    for i in 0..moves {
        tokio::time::sleep(Duration::from_millis(rand::thread_rng().gen_range(40..160))).await;
        if co.out.join("r.consumed").exists() {
            break;
        }
        let frozen_at = Instant::now();
        let to = 1 - set.site;
        let (mut started, mut cut_bytes) = (None, 0);
        let outcome = move_set(&mut set.controls, limits, |plan| {
            cut_bytes = plan.iter().map(Vec::len).sum();
            let started = &mut started;
            let co = &co;
            async move {
                let running = co.start(to, Some(&plan), sabotage_at == Some(i)).await?;
                *started = Some((running.children, running.site));
                Ok(running.controls)
            }
        })
        .await
        .expect("the source's members answer");
        match outcome {
            MoveOutcome::Moved(controls) => {
                report.done += 1;
                report
                    .times
                    .push((frozen_at.elapsed().as_millis(), cut_bytes));
                let (children, site) = started.expect("started");
                let old = std::mem::replace(
                    &mut set,
                    Running {
                        children,
                        controls,
                        site,
                    },
                );
                for mut child in old.children {
                    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
                        .await
                        .expect("source member exits")
                        .unwrap();
                    assert!(status.success(), "source member: {status}");
                }
            }
            MoveOutcome::Refused(why) => report.refused.push(why),
            MoveOutcome::DestinationFailed(e) => {
                // The destination's processes were killed on drop; the
                // source goes on.
                eprintln!("move {i}: destination failed: {e}");
                report.destination_failed += 1;
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(co.out.join("r.consumed").exists() && co.out.join("w.hist").exists()) {
        if let Ok(e) = std::fs::read_to_string(co.out.join("r.error")) {
            panic!("the consumer saw: {e} ({report:?})");
        }
        assert!(
            Instant::now() < deadline,
            "the consumer did not finish: {report:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let consumed = std::fs::read(co.out.join("r.consumed")).unwrap();
    let hist = std::fs::read(co.out.join("w.hist")).unwrap();
    assert_eq!(hist.len() as u64, RECORDS * 8);
    let agree = consumed
        .chunks(8)
        .zip(hist.chunks(8))
        .take_while(|(a, b)| a == b)
        .count();
    assert!(
        consumed == hist,
        "the consumer's {} records agree with the producer's {} only on the first {agree} ({report:?})",
        consumed.len() / 8,
        hist.len() / 8
    );
    for c in &mut set.controls {
        let _ = c.end().await;
    }
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_move_between_sites_mid_stream_and_every_record_arrives_once() {
    let report = run(None, 6, None, "unix").await;
    eprintln!("{report:?}");
    assert!(report.done >= 3, "{report:?}");
    assert!(report.refused.is_empty(), "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_killed_mid_move_leaves_the_set_running_at_the_source() {
    let report = run(None, 4, Some(1), "unix").await;
    eprintln!("{report:?}");
    assert_eq!(report.destination_failed, 1, "{report:?}");
    assert!(report.done >= 1, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_over_its_cap_refuses_the_move_with_the_reason_and_loses_nothing() {
    let report = run(Some(64), 4, None, "unix").await;
    eprintln!("{report:?}");
    assert!(!report.refused.is_empty(), "{report:?}");
    assert!(
        report
            .refused
            .iter()
            .all(|why| why.contains("over its cap")),
        "{report:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_set_over_tcp_connections_moves_and_every_record_arrives_once() {
    let report = run(None, 4, None, "tcp").await;
    eprintln!("{report:?}");
    assert!(report.done >= 2, "{report:?}");
    assert!(report.refused.is_empty(), "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_set_over_named_pipes_moves_and_every_record_arrives_once() {
    let report = run(None, 4, None, "fifo").await;
    eprintln!("{report:?}");
    assert!(report.done >= 2, "{report:?}");
    assert!(report.refused.is_empty(), "{report:?}");
}
