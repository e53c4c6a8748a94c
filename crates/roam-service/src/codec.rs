//! The encoding of a [`Cut`] (`docs/SERVICE.md`): big-endian, every length
//! checked against what is left before anything is allocated.

use crate::channel::{ChannelId, Interval, ReaderState, WriterState};
use crate::cut::{Cut, Part};
use crate::Error;

/// The first bytes of an encoded cut.
const MAGIC: &[u8; 4] = b"RSVC";
/// The format's version.
const VERSION: u8 = 1;
/// Most processes in one service set.
const MAX_PARTS: u16 = 256;
/// Most channel ends of one kind in one process.
const MAX_ENDS: u16 = 4096;
/// Part flag: a snapshot follows.
const HAS_SNAPSHOT: u8 = 1;
/// Part flag: the process is in a nondeterministic interval.
const NONDETERMINISTIC: u8 = 2;

impl Cut {
    /// The cut as bytes, to travel with the session (`docs/SERVICE.md`).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.logged_bytes() as usize);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&(self.parts.len() as u16).to_be_bytes());
        for part in &self.parts {
            let mut flags = 0;
            if part.snapshot.is_some() {
                flags |= HAS_SNAPSHOT;
            }
            if part.interval == Interval::Nondeterministic {
                flags |= NONDETERMINISTIC;
            }
            out.push(flags);
            if let Some(s) = &part.snapshot {
                put_bytes(&mut out, s);
            }
            out.extend_from_slice(&(part.writers.len() as u16).to_be_bytes());
            for (id, w) in &part.writers {
                out.extend_from_slice(&id.0.to_be_bytes());
                out.extend_from_slice(&w.lsw.to_be_bytes());
                out.extend_from_slice(&w.sent.to_be_bytes());
                put_bytes(&mut out, &w.unsent);
            }
            out.extend_from_slice(&(part.readers.len() as u16).to_be_bytes());
            for (id, r) in &part.readers {
                out.extend_from_slice(&id.0.to_be_bytes());
                out.extend_from_slice(&r.lsr.to_be_bytes());
                put_bytes(&mut out, &r.log);
            }
        }
        out
    }

    /// Decodes a cut, refusing anything malformed with where and why.
    pub fn decode(bytes: &[u8]) -> Result<Cut, Error> {
        let mut r = Reader { bytes, at: 0 };
        if r.take(4, "the magic")? != MAGIC {
            return Err(r.malformed("not a service continuation (bad magic)"));
        }
        if r.u8("the version")? != VERSION {
            return Err(r.malformed("unknown version"));
        }
        let count = r.u16("the part count")?;
        if count > MAX_PARTS {
            return Err(r.malformed("more than 256 parts"));
        }
        let mut parts = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let flags = r.u8("a part's flags")?;
            if flags & !(HAS_SNAPSHOT | NONDETERMINISTIC) != 0 {
                return Err(r.malformed("unknown part flags"));
            }
            let snapshot = if flags & HAS_SNAPSHOT != 0 {
                Some(r.bytes("a snapshot")?.to_vec())
            } else {
                None
            };
            let interval = if flags & NONDETERMINISTIC != 0 {
                Interval::Nondeterministic
            } else {
                Interval::Deterministic
            };
            let n = r.ends("writer")?;
            let mut writers = Vec::with_capacity(n);
            for _ in 0..n {
                let id = ChannelId(r.u32("a channel id")?);
                let lsw = r.u64("a writer's lsw")?;
                let sent = r.u64("a writer's sent position")?;
                let unsent = r.bytes("a writer's unsent bytes")?.to_vec();
                if !unsent.is_empty() && sent.checked_add(unsent.len() as u64) != Some(lsw) {
                    return Err(r.malformed("a writer's unsent bytes do not end at its lsw"));
                }
                writers.push((id, WriterState { lsw, sent, unsent }));
            }
            let n = r.ends("reader")?;
            let mut readers = Vec::with_capacity(n);
            for _ in 0..n {
                let id = ChannelId(r.u32("a channel id")?);
                let lsr = r.u64("a reader's lsr")?;
                let log = r.bytes("a reader's log")?.to_vec();
                if lsr.checked_add(log.len() as u64).is_none() {
                    return Err(r.malformed("a reader's log runs past 2^64"));
                }
                readers.push((id, ReaderState { lsr, log }));
            }
            parts.push(Part {
                snapshot,
                interval,
                writers,
                readers,
            });
        }
        if r.at != bytes.len() {
            return Err(r.malformed("trailing bytes after the last part"));
        }
        Ok(Cut { parts })
    }
}

/// A length-prefixed byte string.
fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(b);
}

/// A cursor over the input.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn malformed(&self, what: &'static str) -> Error {
        Error::Malformed {
            offset: self.at,
            what,
        }
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], Error> {
        if self.bytes.len() - self.at < n {
            return Err(Error::Truncated {
                offset: self.at,
                what,
            });
        }
        let b = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(b)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, Error> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, Error> {
        Ok(u16::from_be_bytes(
            self.take(2, what)?.try_into().expect("2 bytes"),
        ))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, Error> {
        Ok(u32::from_be_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, Error> {
        Ok(u64::from_be_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }

    fn bytes(&mut self, what: &'static str) -> Result<&'a [u8], Error> {
        let n = self.u32(what)? as usize;
        self.take(n, what)
    }

    fn ends(&mut self, kind: &'static str) -> Result<usize, Error> {
        let n = self.u16(if kind == "writer" {
            "a writer count"
        } else {
            "a reader count"
        })?;
        if n > MAX_ENDS {
            return Err(self.malformed(if kind == "writer" {
                "more than 4096 writer ends in a part"
            } else {
                "more than 4096 reader ends in a part"
            }));
        }
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Cut {
        Cut {
            parts: vec![
                Part {
                    snapshot: Some(b"front".to_vec()),
                    interval: Interval::Deterministic,
                    writers: vec![(
                        ChannelId(1),
                        WriterState {
                            lsw: 10,
                            sent: 7,
                            unsent: b"abc".to_vec(),
                        },
                    )],
                    readers: vec![(
                        ChannelId(2),
                        ReaderState {
                            lsr: 3,
                            log: b"xyz".to_vec(),
                        },
                    )],
                },
                Part {
                    snapshot: None,
                    interval: Interval::Nondeterministic,
                    writers: vec![],
                    readers: vec![],
                },
            ],
        }
    }

    #[test]
    fn a_cut_round_trips() {
        let cut = sample();
        assert_eq!(Cut::decode(&cut.encode()).unwrap(), cut);
    }

    #[test]
    fn every_truncation_and_a_trailing_byte_are_refused() {
        let bytes = sample().encode();
        for n in 0..bytes.len() {
            let err = Cut::decode(&bytes[..n]).unwrap_err();
            assert!(matches!(err, Error::Truncated { .. }), "{n}: {err}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(matches!(
            Cut::decode(&long),
            Err(Error::Malformed {
                what: "trailing bytes after the last part",
                ..
            })
        ));
    }

    #[test]
    fn a_huge_length_is_refused_without_allocating_it() {
        let mut bytes = b"RSVC\x01\x00\x01\x01".to_vec();
        bytes.extend_from_slice(&u32::MAX.to_be_bytes());
        let err = Cut::decode(&bytes).unwrap_err();
        assert_eq!(
            err,
            Error::Truncated {
                offset: 12,
                what: "a snapshot"
            }
        );
    }

    #[test]
    fn unsent_bytes_that_do_not_end_at_lsw_are_refused() {
        let mut cut = sample();
        cut.parts[0].writers[0].1.lsw = 11;
        assert!(matches!(
            Cut::decode(&cut.encode()),
            Err(Error::Malformed {
                what: "a writer's unsent bytes do not end at its lsw",
                ..
            })
        ));
    }
}
