//! A verifying bidirectional workload for simulated sessions.
//!
//! Every stream carries a known number of bytes each way; byte `i` of stream
//! `s` has a value derived from `(s, i)`, so any loss, duplication or
//! reordering is detected at the first wrong byte. The client opens the
//! streams; the server answers on each stream it sees.

use std::collections::BTreeMap;

use roam_proto::{Event, Session, StreamId};

use crate::net::Sim;

/// The expected value of byte `i` of stream `stream`.
pub fn pattern(stream: u64, i: u64) -> u8 {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ stream.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    (x >> 32) as u8
}

/// One direction of one stream.
#[derive(Debug, Default, Clone)]
pub struct Flow {
    /// Bytes to send.
    pub total: u64,
    /// Bytes written so far.
    pub sent: u64,
    /// `finish_stream` was called.
    pub fin: bool,
    /// Bytes received and verified so far.
    pub received: u64,
    /// End-of-stream seen (after exactly `total` bytes).
    pub eof: bool,
    /// `StreamSendComplete` seen.
    pub acked: bool,
}

/// Per-side state: what it sends on each stream and what it has verified.
#[derive(Debug, Default)]
pub struct Side {
    /// Per stream: (our sending flow, the flow we receive).
    pub streams: BTreeMap<u64, (Flow, Flow)>,
    /// Index of the next event of this side to look at.
    pub event_pos: usize,
    /// Streams whose reader is deliberately stalled.
    pub stalled: Vec<u64>,
    /// Write no more than this many bytes per call (0 = unlimited).
    pub write_chunk: usize,
}

/// The whole workload: `streams` streams, `bytes_each_way` bytes per direction.
#[derive(Debug)]
pub struct Workload {
    /// The client's view.
    pub client: Side,
    /// The server's view.
    pub server: Side,
    /// Bytes each stream carries in each direction.
    pub bytes_each_way: u64,
    /// The first verification failure, if any.
    pub error: Option<String>,
    scratch: Vec<u8>,
}

impl Workload {
    /// Waits (in simulated time, at most a minute) for the client to connect,
    /// then opens `streams` streams on it.
    pub fn start(sim: &mut Sim, streams: usize, bytes_each_way: u64) -> Self {
        let deadline = sim.now + std::time::Duration::from_secs(60);
        sim.run_until(deadline, |s| s.client.id().is_some());
        let mut client = Side::default();
        for i in 0..streams {
            let id = sim
                .client
                .open_stream(format!("stream-{i}").as_bytes())
                .expect("open");
            client.streams.insert(
                id.0,
                (
                    Flow {
                        total: bytes_each_way,
                        ..Flow::default()
                    },
                    Flow {
                        total: bytes_each_way,
                        ..Flow::default()
                    },
                ),
            );
        }
        Self {
            client,
            server: Side::default(),
            bytes_each_way,
            error: None,
            scratch: vec![0; 64 * 1024],
        }
    }

    /// Moves data on both sides and verifies it. Returns `true` when every
    /// stream has delivered everything both ways and every finish was acknowledged.
    pub fn pump(&mut self, sim: &mut Sim) -> bool {
        if self.error.is_some() {
            return true;
        }
        let total = self.bytes_each_way;
        let r1 = pump_side(
            &mut sim.client,
            &sim.client_events,
            &mut self.client,
            &mut self.scratch,
            None,
        );
        let r2 = match sim.server.as_mut() {
            Some(s) => pump_side(
                s,
                &sim.server_events,
                &mut self.server,
                &mut self.scratch,
                Some(total),
            ),
            None => Ok(()),
        };
        if let Err(e) = r1.and(r2) {
            self.error = Some(e);
            return true;
        }
        self.done()
    }

    /// Every flow complete both ways.
    pub fn done(&self) -> bool {
        let side_done = |s: &Side| s.streams.values().all(|(tx, rx)| tx.acked && rx.eof);
        self.server.streams.len() == self.client.streams.len()
            && side_done(&self.client)
            && side_done(&self.server)
    }

    /// Bytes verified on both sides.
    pub fn verified_bytes(&self) -> u64 {
        let s = |side: &Side| {
            side.streams
                .values()
                .map(|(_, rx)| rx.received)
                .sum::<u64>()
        };
        s(&self.client) + s(&self.server)
    }
}

fn pump_side(
    session: &mut Session,
    events: &[Event],
    side: &mut Side,
    scratch: &mut [u8],
    answer_total: Option<u64>,
) -> Result<(), String> {
    for e in &events[side.event_pos..] {
        match e {
            Event::StreamOpened { stream } => {
                if let Some(total) = answer_total {
                    side.streams.insert(
                        stream.0,
                        (
                            Flow {
                                total,
                                ..Flow::default()
                            },
                            Flow {
                                total,
                                ..Flow::default()
                            },
                        ),
                    );
                }
            }
            Event::StreamSendComplete { stream } => {
                if let Some((tx, _)) = side.streams.get_mut(&stream.0) {
                    if tx.sent != tx.total || !tx.fin {
                        return Err(format!("stream {}: send complete before finish", stream.0));
                    }
                    tx.acked = true;
                }
            }
            Event::StreamReset { stream, code } => {
                return Err(format!("stream {} reset with {code}", stream.0))
            }
            _ => {}
        }
    }
    side.event_pos = events.len();
    for (&id, (tx, rx)) in side.streams.iter_mut() {
        let sid = StreamId(id);
        // write
        while tx.sent < tx.total {
            let mut n = (tx.total - tx.sent).min(scratch.len() as u64) as usize;
            if side.write_chunk > 0 {
                n = n.min(side.write_chunk);
            }
            for (k, b) in scratch[..n].iter_mut().enumerate() {
                *b = pattern(id, tx.sent + k as u64);
            }
            let w = session
                .write(sid, &scratch[..n])
                .map_err(|e| format!("stream {id}: write: {e}"))?;
            tx.sent += w as u64;
            if w < n {
                break;
            }
        }
        if tx.sent == tx.total && !tx.fin {
            session
                .finish_stream(sid)
                .map_err(|e| format!("stream {id}: finish: {e}"))?;
            tx.fin = true;
        }
        // read
        if side.stalled.contains(&id) || rx.eof {
            continue;
        }
        loop {
            match session.read(sid, scratch) {
                Ok(None) => break,
                Ok(Some(0)) => {
                    if rx.received != rx.total {
                        return Err(format!(
                            "stream {id}: EOF after {} of {} bytes",
                            rx.received, rx.total
                        ));
                    }
                    rx.eof = true;
                    break;
                }
                Ok(Some(n)) => {
                    for (k, b) in scratch[..n].iter().enumerate() {
                        let i = rx.received + k as u64;
                        if *b != pattern(id, i) {
                            return Err(format!(
                                "stream {id}: byte {i} wrong (lost, duplicated or reordered data)"
                            ));
                        }
                    }
                    rx.received += n as u64;
                    if rx.received > rx.total {
                        return Err(format!(
                            "stream {id}: {} bytes, more than the {} sent",
                            rx.received, rx.total
                        ));
                    }
                }
                Err(e) => return Err(format!("stream {id}: read: {e}")),
            }
        }
    }
    Ok(())
}
