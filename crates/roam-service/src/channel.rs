//! The two ends of a logged channel: what a writer sends, holds back or
//! discards, and what a reader logs since its last export.

use std::fmt;

use crate::Error;

/// Names one unidirectional channel of a service set (unique within it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChannelId(pub u32);

impl fmt::Display for ChannelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// The kind of interval a process enters after an export (paper §4, §5.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interval {
    /// Output depends only on the channels' input: a replay writes the same
    /// bytes, so output goes out at once.
    Deterministic,
    /// Output may differ on a replay (clocks, randomness, a database's
    /// answer): it is held back until the next export.
    Nondeterministic,
}

/// Caps on what the ends keep, so memory stays bounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Bytes a reader may have read since its last export and still move
    /// (its log). Past it the log is dropped and a cut fails with
    /// [`Error::LogOverflow`] until the next export.
    pub log_bytes: usize,
    /// Bytes a writer may hold back in a nondeterministic interval.
    pub hold_bytes: usize,
    /// Bytes a writer keeps waiting for the channel (back-pressure: past it
    /// [`WriteEnd::write`] accepts less).
    pub send_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            log_bytes: 16 << 20,
            hold_bytes: 16 << 20,
            send_bytes: 1 << 20,
        }
    }
}

/// A writer end's part of a cut.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriterState {
    /// The first byte the process writes after its last export (`lsw`).
    pub lsw: u64,
    /// The first byte not yet handed to the channel.
    pub sent: u64,
    /// Bytes `[sent, lsw)`: written before the snapshot, not yet sent (a
    /// nondeterministic interval's output released by the export). Empty
    /// when `sent >= lsw`.
    pub unsent: Vec<u8>,
}

/// A reader end's part of a cut.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReaderState {
    /// The first byte the process reads after its last export (`lsr`).
    pub lsr: u64,
    /// Bytes `[lsr, lsr + log.len())`: read since the export, then received
    /// and not read yet.
    pub log: Vec<u8>,
}

/// The end of a channel a process writes to.
#[derive(Debug)]
pub struct WriteEnd {
    /// Which channel.
    id: ChannelId,
    /// The application's position: bytes it has written, replays included once.
    pos: u64,
    /// The position at the last export.
    lsw: u64,
    /// The interval entered at the last export.
    interval: Interval,
    /// Bytes ready for the channel; `out[head..]` starts at `sent`.
    out: Vec<u8>,
    /// How much of `out` was already sent (compacted lazily).
    head: usize,
    /// The first byte not yet handed to the channel.
    sent: u64,
    /// Application bytes below this position are dropped: after a move the
    /// reader already has them (write discard).
    discard_below: u64,
    /// A nondeterministic interval's output, `[pos - held.len(), pos)`.
    held: Vec<u8>,
    /// Caps.
    limits: Limits,
}

impl WriteEnd {
    /// A writer at the start of a new channel.
    pub fn new(id: ChannelId, limits: Limits) -> Self {
        Self::at(id, 0, 0, Interval::Deterministic, limits)
    }

    /// A writer whose application restarts at `lsw` and whose channel
    /// restarts at `resume` (>= `lsw`): a move's restart.
    pub(crate) fn at(
        id: ChannelId,
        lsw: u64,
        resume: u64,
        interval: Interval,
        limits: Limits,
    ) -> Self {
        WriteEnd {
            id,
            pos: lsw,
            lsw,
            interval,
            out: Vec::new(),
            head: 0,
            sent: resume,
            discard_below: resume,
            held: Vec::new(),
            limits,
        }
    }

    /// The channel this end writes.
    pub fn id(&self) -> ChannelId {
        self.id
    }

    /// The application's position (bytes it has written).
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// Takes the application's bytes; returns how many it took (fewer than
    /// `data.len()` when the send buffer is full: send [`pending`](Self::pending)
    /// first). Bytes the channel's reader already has after a move are
    /// taken and dropped; in a nondeterministic interval they are held back.
    pub fn write(&mut self, data: &[u8]) -> Result<usize, Error> {
        let skip = usize::try_from(self.discard_below.saturating_sub(self.pos))
            .unwrap_or(usize::MAX)
            .min(data.len());
        let rest = &data[skip..];
        let take = match self.interval {
            Interval::Nondeterministic => {
                if self.held.len() + rest.len() > self.limits.hold_bytes {
                    return Err(Error::HoldFull {
                        channel: self.id,
                        cap: self.limits.hold_bytes,
                    });
                }
                self.held.extend_from_slice(rest);
                rest.len()
            }
            Interval::Deterministic => {
                let room = self
                    .limits
                    .send_bytes
                    .saturating_sub(self.out.len() - self.head);
                let take = rest.len().min(room);
                self.out.extend_from_slice(&rest[..take]);
                take
            }
        };
        self.pos += (skip + take) as u64;
        Ok(skip + take)
    }

    /// Bytes to hand to the channel now.
    pub fn pending(&self) -> &[u8] {
        &self.out[self.head..]
    }

    /// `n` bytes of [`pending`](Self::pending) reached the channel.
    pub fn sent(&mut self, n: usize) -> Result<(), Error> {
        if n > self.out.len() - self.head {
            return Err(Error::Misuse("more bytes reported sent than were pending"));
        }
        self.head += n;
        self.sent += n as u64;
        if self.head == self.out.len() {
            self.out.clear();
            self.head = 0;
        } else if self.head > 64 << 10 && self.head * 2 > self.out.len() {
            self.out.drain(..self.head);
            self.head = 0;
        }
        Ok(())
    }

    /// The process exported: everything written so far lies before the
    /// snapshot, so held bytes may go out; `next` is the interval entered.
    pub(crate) fn export(&mut self, next: Interval) {
        self.lsw = self.pos;
        self.out.append(&mut self.held);
        self.interval = next;
    }

    /// This end's part of a cut.
    pub fn state(&self) -> WriterState {
        let unsent = match usize::try_from(self.lsw.saturating_sub(self.sent)) {
            Ok(n) => self.pending()[..n.min(self.pending().len())].to_vec(),
            Err(_) => self.pending().to_vec(),
        };
        WriterState {
            lsw: self.lsw,
            sent: self.sent,
            unsent,
        }
    }
}

/// The end of a channel a process reads from.
#[derive(Debug)]
pub struct ReadEnd {
    /// Which channel.
    id: ChannelId,
    /// The position at the last export.
    lsr: u64,
    /// The application's position (bytes it has read).
    read: u64,
    /// Bytes `[base, base + buf.len())`: the log and what is not read yet.
    buf: Vec<u8>,
    /// Where `buf` starts: `lsr`, or later once the log overflowed.
    base: u64,
    /// The log went over its cap since the last export and was dropped.
    overflowed: bool,
    /// Caps.
    limits: Limits,
}

impl ReadEnd {
    /// A reader at the start of a new channel.
    pub fn new(id: ChannelId, limits: Limits) -> Self {
        Self::at(id, 0, Vec::new(), limits)
    }

    /// A reader that restarts at `lsr` and reads `replay` again first.
    pub(crate) fn at(id: ChannelId, lsr: u64, replay: Vec<u8>, limits: Limits) -> Self {
        ReadEnd {
            id,
            lsr,
            read: lsr,
            buf: replay,
            base: lsr,
            overflowed: false,
            limits,
        }
    }

    /// The channel this end reads.
    pub fn id(&self) -> ChannelId {
        self.id
    }

    /// The application's position (bytes it has read).
    pub fn position(&self) -> u64 {
        self.read
    }

    /// The first byte the channel will deliver next.
    pub fn received(&self) -> u64 {
        self.base + self.buf.len() as u64
    }

    /// Bytes that arrived from the channel.
    pub fn receive(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// Bytes received and not read yet.
    pub fn unread(&self) -> &[u8] {
        &self.buf[(self.read - self.base) as usize..]
    }

    /// The application read `n` bytes of [`unread`](Self::unread).
    pub fn consume(&mut self, n: usize) -> Result<(), Error> {
        if n > self.unread().len() {
            return Err(Error::Misuse("more bytes consumed than were unread"));
        }
        self.read += n as u64;
        if self.read - self.lsr > self.limits.log_bytes as u64 {
            // Over the cap: keep only what is unread; a cut fails until the
            // next export.
            self.overflowed = true;
            self.buf.drain(..(self.read - self.base) as usize);
            self.base = self.read;
        }
        Ok(())
    }

    /// Copies unread bytes into `out`; returns how many.
    pub fn read(&mut self, out: &mut [u8]) -> usize {
        let n = self.unread().len().min(out.len());
        out[..n].copy_from_slice(&self.unread()[..n]);
        self.consume(n).expect("n is within unread");
        n
    }

    /// Bytes read since the last export (what a move would carry back).
    pub fn logged(&self) -> u64 {
        self.read - self.lsr
    }

    /// The process exported: what it read is in its snapshot.
    pub(crate) fn export(&mut self) {
        self.buf.drain(..(self.read - self.base) as usize);
        self.base = self.read;
        self.lsr = self.read;
        self.overflowed = false;
    }

    /// This end's part of a cut.
    pub fn state(&self) -> Result<ReaderState, Error> {
        if self.overflowed {
            return Err(Error::LogOverflow {
                channel: self.id,
                logged: self.logged(),
                cap: self.limits.log_bytes,
            });
        }
        debug_assert_eq!(self.base, self.lsr);
        Ok(ReaderState {
            lsr: self.lsr,
            log: self.buf.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: ChannelId = ChannelId(7);

    #[test]
    fn a_nondeterministic_interval_holds_output_until_the_next_export() {
        let mut w = WriteEnd::new(C, Limits::default());
        w.write(b"safe").unwrap();
        w.export(Interval::Nondeterministic);
        w.write(b"maybe").unwrap();
        assert_eq!(w.pending(), b"safe");
        assert_eq!(w.state().lsw, 4);
        w.export(Interval::Deterministic);
        assert_eq!(w.pending(), b"safemaybe");
        // Not sent yet, but before the snapshot: the cut carries it.
        assert_eq!(w.state().unsent, b"safemaybe");
        w.sent(6).unwrap();
        assert_eq!(w.state().unsent, b"ybe");
        assert_eq!(w.state().sent, 6);
    }

    #[test]
    fn held_output_has_a_cap_and_a_refused_write_changes_nothing() {
        let limits = Limits {
            hold_bytes: 8,
            ..Limits::default()
        };
        let mut w = WriteEnd::new(C, limits);
        w.export(Interval::Nondeterministic);
        w.write(b"12345").unwrap();
        assert_eq!(
            w.write(b"6789"),
            Err(Error::HoldFull { channel: C, cap: 8 })
        );
        assert_eq!(w.position(), 5);
        w.export(Interval::Deterministic);
        assert_eq!(w.pending(), b"12345");
    }

    #[test]
    fn a_full_send_buffer_takes_less_and_reporting_too_much_sent_is_refused() {
        let limits = Limits {
            send_bytes: 4,
            ..Limits::default()
        };
        let mut w = WriteEnd::new(C, limits);
        assert_eq!(w.write(b"abcdef").unwrap(), 4);
        assert_eq!(w.write(b"ef").unwrap(), 0);
        assert!(matches!(w.sent(5), Err(Error::Misuse(_))));
        w.sent(3).unwrap();
        assert_eq!(w.write(b"ef").unwrap(), 2);
        assert_eq!(w.pending(), b"def");
    }

    #[test]
    fn after_a_move_the_writer_discards_what_the_reader_already_has() {
        let mut w = WriteEnd::at(C, 10, 14, Interval::Deterministic, Limits::default());
        assert_eq!(w.write(b"ab").unwrap(), 2);
        assert_eq!(w.pending(), b"");
        assert_eq!(w.write(b"cdef").unwrap(), 4);
        assert_eq!(w.pending(), b"ef");
        assert_eq!(w.position(), 16);
    }

    #[test]
    fn a_reader_logs_since_its_last_export_and_refuses_a_cut_past_its_cap() {
        let limits = Limits {
            log_bytes: 6,
            ..Limits::default()
        };
        let mut r = ReadEnd::new(C, limits);
        r.receive(b"hello world");
        let mut buf = [0; 5];
        assert_eq!(r.read(&mut buf), 5);
        let s = r.state().unwrap();
        assert_eq!((s.lsr, &s.log[..]), (0, &b"hello world"[..]));
        r.export();
        assert_eq!(r.state().unwrap().log, b" world");
        assert_eq!(r.read(&mut [0; 4]), 4);
        assert_eq!(r.read(&mut [0; 4]), 2);
        r.receive(b"!!");
        assert_eq!(r.read(&mut [0; 1]), 1);
        assert_eq!(
            r.state(),
            Err(Error::LogOverflow {
                channel: C,
                logged: 7,
                cap: 6
            })
        );
        // What was not read yet is kept; the next export makes cuts possible again.
        assert_eq!(r.unread(), b"!");
        r.export();
        assert_eq!(r.state().unwrap().log, b"!");
        assert_eq!(r.state().unwrap().lsr, 12);
    }
}
