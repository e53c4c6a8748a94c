//! A process's ends and snapshot ([`Process`]), its part of a cut
//! ([`Part`]), and the cut of a whole service set ([`Cut`]) with the
//! check-then-restart that turns it into processes at the destination.

use std::collections::BTreeMap;

use crate::channel::{ChannelId, Interval, Limits, ReadEnd, ReaderState, WriteEnd, WriterState};
use crate::Error;

/// One process of a service set, as this crate sees it: the channel ends it
/// associated and its last exported snapshot.
#[derive(Debug)]
pub struct Process {
    /// Ends this process writes, by channel.
    writers: BTreeMap<ChannelId, WriteEnd>,
    /// Ends this process reads, by channel.
    readers: BTreeMap<ChannelId, ReadEnd>,
    /// The last exported snapshot; `None` until the first export.
    snapshot: Option<Vec<u8>>,
    /// The interval entered at the last export.
    interval: Interval,
    /// Caps for the ends it creates.
    limits: Limits,
}

impl Process {
    /// A process that has not exported yet (a fresh start: no snapshot).
    pub fn new(limits: Limits) -> Self {
        Process {
            writers: BTreeMap::new(),
            readers: BTreeMap::new(),
            snapshot: None,
            interval: Interval::Deterministic,
            limits,
        }
    }

    /// `associate`: this process writes channel `id` from now on.
    pub fn associate_writer(&mut self, id: ChannelId) -> Result<&mut WriteEnd, Error> {
        if self.writers.contains_key(&id) {
            return Err(Error::DuplicateChannel { channel: id });
        }
        Ok(self
            .writers
            .entry(id)
            .or_insert_with(|| WriteEnd::new(id, self.limits)))
    }

    /// `associate`: this process reads channel `id` from now on.
    pub fn associate_reader(&mut self, id: ChannelId) -> Result<&mut ReadEnd, Error> {
        if self.readers.contains_key(&id) {
            return Err(Error::DuplicateChannel { channel: id });
        }
        Ok(self
            .readers
            .entry(id)
            .or_insert_with(|| ReadEnd::new(id, self.limits)))
    }

    /// The end this process writes on channel `id`.
    pub fn writer(&mut self, id: ChannelId) -> Result<&mut WriteEnd, Error> {
        self.writers
            .get_mut(&id)
            .ok_or(Error::UnknownChannel { channel: id })
    }

    /// The end this process reads on channel `id`.
    pub fn reader(&mut self, id: ChannelId) -> Result<&mut ReadEnd, Error> {
        self.readers
            .get_mut(&id)
            .ok_or(Error::UnknownChannel { channel: id })
    }

    /// Every end this process writes.
    pub fn writers_mut(&mut self) -> impl Iterator<Item = &mut WriteEnd> {
        self.writers.values_mut()
    }

    /// Every end this process reads.
    pub fn readers_mut(&mut self) -> impl Iterator<Item = &mut ReadEnd> {
        self.readers.values_mut()
    }

    /// `import_state`: the snapshot to resume from, or `None` on a fresh start.
    pub fn snapshot(&self) -> Option<&[u8]> {
        self.snapshot.as_deref()
    }

    /// The interval the process is in (entered at its last export).
    pub fn interval(&self) -> Interval {
        self.interval
    }

    /// `export_state`, eager: copies `snapshot` and records, at the same
    /// instant, every channel's position. `next` is the interval entered:
    /// in a [`Interval::Nondeterministic`] one, output is held until the
    /// next export.
    pub fn export(&mut self, snapshot: &[u8], next: Interval) {
        let mut buf = self.snapshot.take().unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(snapshot);
        self.export_owned(buf, next);
    }

    /// `export_state`, lazy: takes the snapshot's buffer without copying and
    /// hands back the previous one for the next snapshot (the paper's pair
    /// of alternating buffers).
    pub fn export_owned(&mut self, snapshot: Vec<u8>, next: Interval) -> Option<Vec<u8>> {
        for w in self.writers.values_mut() {
            w.export(next);
        }
        for r in self.readers.values_mut() {
            r.export();
        }
        self.interval = next;
        self.snapshot.replace(snapshot)
    }

    /// A process restarted by [`Cut::resume`] elsewhere, from the part
    /// [`Process::part`] gave of it there (one encoded [`Cut`] per process
    /// travels to the process that will run it). Refuses a part that
    /// carries unsent bytes: only a whole cut can place those.
    pub fn restarted(part: &Part, limits: Limits) -> Result<Process, Error> {
        let mut p = Process::new(limits);
        p.snapshot = part.snapshot.clone();
        p.interval = part.interval;
        for (id, w) in &part.writers {
            if !w.unsent.is_empty() || w.sent < w.lsw {
                return Err(Error::Misuse(
                    "a running process's part: restart from Cut::resume, not Process::restarted",
                ));
            }
            if p.writers.contains_key(id) {
                return Err(Error::DuplicateChannel { channel: *id });
            }
            p.writers
                .insert(*id, WriteEnd::at(*id, w.lsw, w.sent, part.interval, limits));
        }
        for (id, r) in &part.readers {
            if p.readers.contains_key(id) {
                return Err(Error::DuplicateChannel { channel: *id });
            }
            p.readers
                .insert(*id, ReadEnd::at(*id, r.lsr, r.log.clone(), limits));
        }
        Ok(p)
    }

    /// This process's part of a cut. Fails with [`Error::LogOverflow`] when
    /// a reader's log went over its cap since the last export.
    pub fn part(&self) -> Result<Part, Error> {
        Ok(Part {
            snapshot: self.snapshot.clone(),
            interval: self.interval,
            writers: self.writers.values().map(|w| (w.id(), w.state())).collect(),
            readers: self
                .readers
                .values()
                .map(|r| r.state().map(|s| (r.id(), s)))
                .collect::<Result<_, _>>()?,
        })
    }
}

/// One process's part of a service continuation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// The last exported snapshot; `None` if the process never exported.
    pub snapshot: Option<Vec<u8>>,
    /// The interval it entered at that export.
    pub interval: Interval,
    /// Its writer ends.
    pub writers: Vec<(ChannelId, WriterState)>,
    /// Its reader ends.
    pub readers: Vec<(ChannelId, ReaderState)>,
}

/// A service continuation: every process's part, in the service set's order
/// (the root process first).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Cut {
    /// The parts.
    pub parts: Vec<Part>,
}

/// Where a channel's two ends are in a cut.
struct Ends<'a> {
    writer: Option<&'a WriterState>,
    reader: Option<&'a ReaderState>,
}

impl Cut {
    /// The cut of these processes, in the service set's order. Take it with
    /// the processes frozen and every channel drained into its reader.
    pub fn of<'a>(processes: impl IntoIterator<Item = &'a Process>) -> Result<Self, Error> {
        Ok(Cut {
            parts: processes
                .into_iter()
                .map(Process::part)
                .collect::<Result<_, _>>()?,
        })
    }

    /// Total bytes of channel state the cut carries (logs and unsent bytes).
    pub fn logged_bytes(&self) -> u64 {
        let mut n = 0u64;
        for part in &self.parts {
            n += part
                .writers
                .iter()
                .map(|(_, w)| w.unsent.len() as u64)
                .sum::<u64>();
            n += part
                .readers
                .iter()
                .map(|(_, r)| r.log.len() as u64)
                .sum::<u64>();
        }
        n
    }

    /// Checks the whole cut and, only if every channel can be resumed,
    /// restarts its processes: each process gets its snapshot back; each
    /// channel restarts at `max(lsr, lsw)`, its reader reading again what
    /// its writer will not write again and its writer discarding what its
    /// reader already has. `limits` caps what a reader may be given back.
    pub fn resume(&self, limits: Limits) -> Result<Vec<Process>, Error> {
        let mut channels: BTreeMap<ChannelId, Ends<'_>> = BTreeMap::new();
        for part in &self.parts {
            for (id, w) in &part.writers {
                let ends = channels.entry(*id).or_insert(Ends {
                    writer: None,
                    reader: None,
                });
                if ends.writer.replace(w).is_some() {
                    return Err(Error::DuplicateEnd {
                        channel: *id,
                        end: "writer",
                    });
                }
            }
            for (id, r) in &part.readers {
                let ends = channels.entry(*id).or_insert(Ends {
                    writer: None,
                    reader: None,
                });
                if ends.reader.replace(r).is_some() {
                    return Err(Error::DuplicateEnd {
                        channel: *id,
                        end: "reader",
                    });
                }
            }
        }
        // Per channel: where it restarts and what its reader reads again.
        let mut plans: BTreeMap<ChannelId, (u64, Vec<u8>)> = BTreeMap::new();
        for (id, ends) in &channels {
            let w = ends.writer.ok_or(Error::MissingEnd {
                channel: *id,
                end: "writer",
            })?;
            let r = ends.reader.ok_or(Error::MissingEnd {
                channel: *id,
                end: "reader",
            })?;
            plans.insert(*id, plan(*id, w, r, limits)?);
        }
        let mut processes = Vec::with_capacity(self.parts.len());
        for part in &self.parts {
            let mut p = Process::new(limits);
            p.snapshot = part.snapshot.clone();
            p.interval = part.interval;
            for (id, w) in &part.writers {
                let (resume, _) = &plans[id];
                p.writers.insert(
                    *id,
                    WriteEnd::at(*id, w.lsw, *resume, part.interval, limits),
                );
            }
            for (id, r) in &part.readers {
                let (_, replay) = plans.get_mut(id).expect("planned above");
                p.readers
                    .insert(*id, ReadEnd::at(*id, r.lsr, std::mem::take(replay), limits));
            }
            processes.push(p);
        }
        Ok(processes)
    }
}

/// One channel's restart: `resume = max(lsr, lsw)` and the bytes
/// `[lsr, resume)` its reader reads again, from its log and from the
/// writer's unsent bytes.
fn plan(
    id: ChannelId,
    w: &WriterState,
    r: &ReaderState,
    limits: Limits,
) -> Result<(u64, Vec<u8>), Error> {
    let inconsistent = |why| Error::Inconsistent { channel: id, why };
    let received = r
        .lsr
        .checked_add(r.log.len() as u64)
        .ok_or(inconsistent("the reader's log runs past 2^64"))?;
    let unsent_end = w
        .sent
        .checked_add(w.unsent.len() as u64)
        .ok_or(inconsistent("the writer's unsent bytes run past 2^64"))?;
    if !w.unsent.is_empty() && unsent_end != w.lsw {
        return Err(inconsistent(
            "the writer's unsent bytes do not end at its export",
        ));
    }
    if received > w.sent {
        return Err(inconsistent("the reader holds bytes its writer never sent"));
    }
    let resume = r.lsr.max(w.lsw);
    let need = resume - r.lsr;
    if need > limits.log_bytes as u64 {
        return Err(Error::LogOverflow {
            channel: id,
            logged: need,
            cap: limits.log_bytes,
        });
    }
    // The log covers [lsr, received); the unsent bytes [sent, lsw).
    let from_log = (resume.min(received) - r.lsr) as usize;
    let mut replay = r.log[..from_log].to_vec();
    let mut at = r.lsr + from_log as u64;
    if at < resume {
        if w.sent > at {
            return Err(Error::Undrained {
                channel: id,
                missing: w.sent - at,
            });
        }
        let start = (at - w.sent) as usize;
        let end = (resume - w.sent) as usize;
        if end > w.unsent.len() {
            return Err(inconsistent("the writer's snapshot is past what it wrote"));
        }
        replay.extend_from_slice(&w.unsent[start..end]);
        at = resume;
    }
    debug_assert_eq!(at, resume);
    Ok((resume, replay))
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: ChannelId = ChannelId(1);

    /// A writer process and a reader process joined by channel C; `wire`
    /// moves what the writer sent into the reader.
    fn pair() -> (Process, Process) {
        let mut w = Process::new(Limits::default());
        w.associate_writer(C).unwrap();
        let mut r = Process::new(Limits::default());
        r.associate_reader(C).unwrap();
        (w, r)
    }

    fn wire(w: &mut Process, r: &mut Process) {
        let we = w.writer(C).unwrap();
        let bytes = we.pending().to_vec();
        we.sent(bytes.len()).unwrap();
        r.reader(C).unwrap().receive(&bytes);
    }

    fn read_all(r: &mut Process) -> Vec<u8> {
        let re = r.reader(C).unwrap();
        let v = re.unread().to_vec();
        re.consume(v.len()).unwrap();
        v
    }

    #[test]
    fn a_reader_behind_its_writer_reads_again_what_the_writer_will_not_write_again() {
        let (mut w, mut r) = pair();
        w.writer(C).unwrap().write(b"0123456789").unwrap();
        w.export(b"w at 10", Interval::Deterministic);
        wire(&mut w, &mut r);
        r.reader(C).unwrap().read(&mut [0; 4]);
        r.export(b"r at 4", Interval::Deterministic);
        r.reader(C).unwrap().read(&mut [0; 3]);
        let cut = Cut::decode(&Cut::of([&w, &r]).unwrap().encode()).unwrap();
        let mut moved = cut.resume(Limits::default()).unwrap();
        let (mut w2, mut r2) = (moved.remove(0), moved.remove(0));
        assert_eq!(r2.snapshot(), Some(&b"r at 4"[..]));
        // [4, 10) comes from the log; the writer goes on from 10.
        assert_eq!(read_all(&mut r2), b"456789");
        w2.writer(C).unwrap().write(b"abc").unwrap();
        wire(&mut w2, &mut r2);
        assert_eq!(read_all(&mut r2), b"abc");
    }

    #[test]
    fn a_reader_ahead_of_its_writer_gets_no_byte_twice() {
        let (mut w, mut r) = pair();
        w.export(b"w at 0", Interval::Deterministic);
        w.writer(C).unwrap().write(b"0123456789").unwrap();
        wire(&mut w, &mut r);
        r.reader(C).unwrap().read(&mut [0; 7]);
        r.export(b"r at 7", Interval::Deterministic);
        let mut moved = Cut::of([&w, &r])
            .unwrap()
            .resume(Limits::default())
            .unwrap();
        let (mut w2, mut r2) = (moved.remove(0), moved.remove(0));
        // The writer replays from 0; [0, 7) is discarded, [7, 10) was
        // received but not read, and is written again (not carried).
        assert_eq!(w2.snapshot(), Some(&b"w at 0"[..]));
        w2.writer(C).unwrap().write(b"0123456789xy").unwrap();
        wire(&mut w2, &mut r2);
        assert_eq!(read_all(&mut r2), b"789xy");
    }

    #[test]
    fn output_held_in_a_nondeterministic_interval_never_reaches_the_reader_before_the_export() {
        let (mut w, mut r) = pair();
        w.export(b"w at 0", Interval::Nondeterministic);
        w.writer(C).unwrap().write(b"12:00").unwrap();
        wire(&mut w, &mut r);
        assert_eq!(read_all(&mut r), b"");
        // A move now: the replay may write another time; nothing of the
        // first is anywhere.
        let mut moved = Cut::of([&w, &r])
            .unwrap()
            .resume(Limits::default())
            .unwrap();
        let (mut w2, mut r2) = (moved.remove(0), moved.remove(0));
        assert_eq!(w2.interval(), Interval::Nondeterministic);
        w2.writer(C).unwrap().write(b"12:01").unwrap();
        w2.export(b"w at 5", Interval::Deterministic);
        wire(&mut w2, &mut r2);
        assert_eq!(read_all(&mut r2), b"12:01");
    }

    #[test]
    fn bytes_released_by_an_export_but_not_sent_yet_travel_with_the_writer() {
        let (mut w, mut r) = pair();
        w.export(b"", Interval::Nondeterministic);
        w.writer(C).unwrap().write(b"answer").unwrap();
        w.export(b"w at 6", Interval::Deterministic);
        // Not sent before the cut.
        let mut moved = Cut::of([&w, &r])
            .unwrap()
            .resume(Limits::default())
            .unwrap();
        let (_, mut r2) = (moved.remove(0), moved.remove(0));
        assert_eq!(read_all(&mut r2), b"answer");
        let _ = &mut r;
    }

    #[test]
    fn a_restarted_process_travels_as_its_own_part() {
        let (mut w, mut r) = pair();
        w.writer(C).unwrap().write(b"0123456789").unwrap();
        wire(&mut w, &mut r);
        w.export(b"w", Interval::Deterministic);
        r.reader(C).unwrap().read(&mut [0; 3]);
        r.export(b"r", Interval::Deterministic);
        r.reader(C).unwrap().read(&mut [0; 2]);
        let moved = Cut::of([&w, &r])
            .unwrap()
            .resume(Limits::default())
            .unwrap();
        // Each restarted process's part, sent to the process that runs it.
        let mut again: Vec<Process> = moved
            .iter()
            .map(|p| Process::restarted(&p.part().unwrap(), Limits::default()).unwrap())
            .collect();
        assert_eq!(read_all(&mut again[1]), b"3456789");
        again[0].writer(C).unwrap().write(b"ab").unwrap();
        assert_eq!(again[0].writer(C).unwrap().pending(), b"ab");
        // A running process's part with unsent bytes is not a restart.
        let mut busy = Process::new(Limits::default());
        busy.associate_writer(C).unwrap().write(b"x").unwrap();
        busy.export(b"", Interval::Deterministic);
        assert!(matches!(
            Process::restarted(&busy.part().unwrap(), Limits::default()),
            Err(Error::Misuse(_))
        ));
    }

    #[test]
    fn a_cut_of_an_undrained_channel_is_refused_by_name() {
        let (mut w, r) = pair();
        w.writer(C).unwrap().write(b"in flight").unwrap();
        w.export(b"", Interval::Deterministic);
        let we = w.writer(C).unwrap();
        let n = we.pending().len();
        we.sent(n).unwrap(); // sent, but never put into the reader
        let err = Cut::of([&w, &r])
            .unwrap()
            .resume(Limits::default())
            .unwrap_err();
        assert_eq!(
            err,
            Error::Undrained {
                channel: C,
                missing: 9
            }
        );
        assert!(err.to_string().contains("drain every channel"));
    }

    #[test]
    fn a_cut_missing_an_end_or_holding_one_twice_is_refused() {
        let (w, r) = pair();
        assert_eq!(
            Cut::of([&w])
                .unwrap()
                .resume(Limits::default())
                .unwrap_err(),
            Error::MissingEnd {
                channel: C,
                end: "reader"
            }
        );
        assert_eq!(
            Cut::of([&w, &r, &r])
                .unwrap()
                .resume(Limits::default())
                .unwrap_err(),
            Error::DuplicateEnd {
                channel: C,
                end: "reader"
            }
        );
    }

    #[test]
    fn a_log_over_the_cap_refuses_the_move_and_the_next_export_allows_it() {
        let limits = Limits {
            log_bytes: 8,
            ..Limits::default()
        };
        let mut w = Process::new(limits);
        w.associate_writer(C).unwrap();
        let mut r = Process::new(limits);
        r.associate_reader(C).unwrap();
        w.writer(C).unwrap().write(b"0123456789").unwrap();
        w.export(b"", Interval::Deterministic);
        wire(&mut w, &mut r);
        read_all(&mut r);
        assert_eq!(
            Cut::of([&w, &r]).unwrap_err(),
            Error::LogOverflow {
                channel: C,
                logged: 10,
                cap: 8
            }
        );
        r.export(b"r at 10", Interval::Deterministic);
        let moved = Cut::of([&w, &r]).unwrap().resume(limits).unwrap();
        assert_eq!(moved.len(), 2);
    }
}
