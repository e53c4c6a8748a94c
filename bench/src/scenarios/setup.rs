//! Scenario 3: set-up time. Each sample opens something new and completes a
//! 1-byte echo through it (so the path is proven end to end), timed from the
//! first call to the echoed byte:
//!
//! - a new stream on infrastructure that already runs: a TCP connect (direct,
//!   through socat, through `ssh -L` = a new ssh channel, through
//!   `roam forward` = a new stream of its session), and `open_stream` on an
//!   existing library session;
//! - a new session: `roam::connect` (TCP + Noise XX) then a stream; a
//!   `roam pipe` process; an `ssh -W` process (a new ssh connection); and a
//!   `socat STDIO` process through the socat relay (the cost of starting a
//!   process, for scale).

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{progress, RatioRow};
use crate::agent::client_config;
use crate::load::{self, Conn};
use crate::peers::{order, Dial, Lab, Peer, DIRECT, ROAM_FORWARD, SOCAT, SSH};
use crate::stats::{ratio, summary, Summary};
use crate::Ctx;

const ROAM_STREAM: &str = "roam-stream";
const ROAM_SESSION: &str = "roam-session";
const ROAM_PIPE_PROC: &str = "roam-pipe";
const SSH_W: &str = "ssh-W";
const SOCAT_PROC: &str = "socat-process";

#[derive(Debug, Serialize)]
pub(crate) struct Row {
    /// `new_stream` or `new_session`.
    pub(crate) kind: &'static str,
    pub(crate) peer: &'static str,
    pub(crate) what: &'static str,
    /// Set-up plus 1-byte echo, microseconds.
    pub(crate) time_us: Summary,
}

#[derive(Debug, Serialize)]
pub(crate) struct Setup {
    pub(crate) rows: Vec<Row>,
    /// roam median / other median (lower is better for roam).
    pub(crate) ratios: Vec<RatioRow>,
}

enum How {
    Peer(Peer),
    LibStream,
    LibSession,
}

struct Case {
    kind: &'static str,
    name: &'static str,
    what: &'static str,
    how: How,
    /// Samples to take (process cases are slow: fewer).
    samples: usize,
}

pub(crate) async fn run(ctx: Arc<Ctx>, lab: Arc<Lab>) -> io::Result<Setup> {
    let plan = &ctx.plan;
    let env = &ctx.env;
    let t = lab.targets.addr;
    let target = t.to_string();
    let fast = plan.setup_samples;
    let slow = plan.setup_process_samples;
    let tcp = |name, addr| {
        How::Peer(Peer {
            name,
            dial: Dial::Tcp(addr),
        })
    };
    let socat_proc = Peer {
        name: SOCAT_PROC,
        dial: Dial::Process {
            program: "socat".into(),
            args: vec!["STDIO".into(), format!("TCP:{}", lab.socat.addr)],
            envs: Vec::new(),
            log: env.log("socat-stdio"),
        },
    };
    let cases = vec![
        Case {
            kind: "new_stream",
            name: DIRECT,
            what: "TCP connect to the target",
            how: tcp(DIRECT, t),
            samples: fast,
        },
        Case {
            kind: "new_stream",
            name: SOCAT,
            what: "TCP connect through the socat relay",
            how: tcp(SOCAT, lab.socat.addr),
            samples: fast,
        },
        Case {
            kind: "new_stream",
            name: SSH,
            what: "TCP connect to ssh -L (new channel of its connection)",
            how: tcp(SSH, lab.ssh.addr),
            samples: fast,
        },
        Case {
            kind: "new_stream",
            name: ROAM_FORWARD,
            what: "TCP connect to roam forward (new stream of its session)",
            how: tcp(ROAM_FORWARD, lab.forward.addr),
            samples: fast,
        },
        Case {
            kind: "new_stream",
            name: ROAM_STREAM,
            what: "open_stream on an existing library session",
            how: How::LibStream,
            samples: fast,
        },
        Case {
            kind: "new_session",
            name: ROAM_SESSION,
            what: "roam::connect (TCP + Noise XX) and a stream",
            how: How::LibSession,
            samples: fast,
        },
        Case {
            kind: "new_session",
            name: ROAM_PIPE_PROC,
            what: "start a roam pipe process (new session)",
            how: How::Peer(lab.serve.pipe_peer(env, ROAM_PIPE_PROC, t)),
            samples: slow,
        },
        Case {
            kind: "new_session",
            name: SSH_W,
            what: "start an ssh -W process (new ssh connection)",
            how: How::Peer(lab.ssh.stdio_peer(env, SSH_W, t)),
            samples: slow,
        },
        Case {
            kind: "new_session",
            name: SOCAT_PROC,
            what: "start a socat STDIO process through the socat relay",
            how: How::Peer(socat_proc),
            samples: slow,
        },
    ];
    let cases: Vec<Case> = cases.into_iter().filter(|c| ctx.wants(c.name)).collect();
    let session = roam::connect(&lab.serve.addr.to_string(), client_config(&ctx.keypair))
        .await
        .map_err(|e| io::Error::other(format!("library session to roam serve: {e}")))?;
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    let rounds = fast.max(slow);
    for round in 0..rounds {
        for i in order(cases.len(), round) {
            let c = &cases[i];
            if round >= c.samples {
                continue;
            }
            let what = format!("set-up via {}", c.name);
            let started = Instant::now();
            let r = tokio::time::timeout(Duration::from_secs(30), async {
                match &c.how {
                    How::Peer(p) => {
                        let mut conn = p.connect(true).await?;
                        load::echo_once(&mut conn).await?;
                        Ok::<_, io::Error>((started.elapsed(), None))
                    }
                    How::LibStream => {
                        let s = session
                            .open_stream(target.as_bytes())
                            .map_err(io::Error::other)?;
                        let mut conn: Conn = Box::new(s);
                        load::echo_once(&mut conn).await?;
                        Ok((started.elapsed(), None))
                    }
                    How::LibSession => {
                        let s =
                            roam::connect(&lab.serve.addr.to_string(), client_config(&ctx.keypair))
                                .await
                                .map_err(io::Error::other)?;
                        let st = s.open_stream(target.as_bytes()).map_err(io::Error::other)?;
                        let mut conn: Conn = Box::new(st);
                        load::echo_once(&mut conn).await?;
                        Ok((started.elapsed(), Some(s)))
                    }
                }
            })
            .await
            .map_err(|_| io::Error::other(format!("{what}: timed out")))?
            .map_err(|e| io::Error::new(e.kind(), format!("{what}: {e}")))?;
            samples[i].push(r.0.as_secs_f64() * 1e6);
            if let Some(s) = r.1 {
                // Close outside the timing, so sessions do not pile up on the relay.
                let _ = tokio::time::timeout(Duration::from_secs(3), s.close(0, "")).await;
            }
        }
        if (round + 1) % 10 == 0 || round + 1 == rounds {
            lab.check_alive()?;
            progress(&format!("setup round {}/{rounds} done", round + 1));
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(3), session.close(0, "")).await;
    let rows: Vec<Row> = cases
        .iter()
        .zip(&samples)
        .map(|(c, s)| Row {
            kind: c.kind,
            peer: c.name,
            what: c.what,
            time_us: summary(s),
        })
        .collect();
    let med = |name: &str| {
        rows.iter()
            .find(|r| r.peer == name)
            .map_or(f64::NAN, |r| r.time_us.median)
    };
    let pairs = [
        ("new stream", ROAM_FORWARD, SOCAT),
        ("new stream", ROAM_FORWARD, SSH),
        ("new stream", ROAM_FORWARD, DIRECT),
        ("new stream", ROAM_STREAM, SOCAT),
        ("new session", ROAM_SESSION, SOCAT),
        ("new session", ROAM_SESSION, SSH_W),
        ("new session", ROAM_PIPE_PROC, SOCAT_PROC),
        ("new session", ROAM_PIPE_PROC, SSH_W),
    ];
    let ratios = pairs
        .iter()
        .map(|(case, r, o)| RatioRow {
            case: case.to_string(),
            roam: r.to_string(),
            versus: o.to_string(),
            ratio: ratio(med(r), med(o)),
        })
        .collect();
    Ok(Setup { rows, ratios })
}
