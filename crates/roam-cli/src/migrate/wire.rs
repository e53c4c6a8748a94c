//! The frames of a process migration's stream (sans-IO; the layout is in
//! `docs/ARCHITECTURE.md`, "Process migration: the stream").
//!
//! The source opens one stream, whose metadata is [`STREAM_META`], on a
//! roam session to the destination's `roam migrate-accept`, and both sides
//! then send frames: a kind byte, a big-endian `u32` payload length (at most
//! [`MAX_PAYLOAD`]) and the payload. Strings are a big-endian `u16` length
//! and UTF-8; numbers are big-endian.

use std::fmt;
use std::net::SocketAddr;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The stream's metadata: names the protocol and its version.
pub(crate) const STREAM_META: &[u8] = b"roam:migrate-process/2";

/// What every version's stream metadata starts with.
const STREAM_META_FAMILY: &[u8] = b"roam:migrate-process/";

/// Why a migration stream whose metadata is `meta` is refused, if it names
/// another version of this protocol than [`STREAM_META`]: a destination
/// says so to the source (in a [`Frame::Failed`], which every version
/// shares) instead of reading frames it may not know. `None` for this
/// version, and for what is not a migration stream at all.
pub(crate) fn other_version(meta: &[u8]) -> Option<String> {
    let version = meta.strip_prefix(STREAM_META_FAMILY)?;
    if meta == STREAM_META || meta == STREAM_PAGES {
        return None;
    }
    Some(format!(
        "the source speaks version {} of the migration stream, this destination {}: \
         run the same roam version at both ends",
        String::from_utf8_lossy(version),
        String::from_utf8_lossy(&STREAM_META[STREAM_META_FAMILY.len()..]),
    ))
}

/// The metadata of the second stream of a post-copy move (`--lazy-pages`):
/// CRIU's page-server protocol between the source's page server and the
/// destination's lazy-pages daemon, carried as it is.
pub(crate) const STREAM_PAGES: &[u8] = b"roam:migrate-process/pages/1";

/// Longest payload of one frame (an image file travels as many
/// [`Frame::Data`] frames).
pub(crate) const MAX_PAYLOAD: usize = 1 << 20;

/// Bytes of a frame's header (kind and length).
pub(crate) const HEADER: usize = 5;

/// Longest image file name accepted (CRIU's are short: `pages-1.img`).
const MAX_NAME: usize = 255;

/// One message of the migration stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Frame {
    /// Source → destination, first: the process to host and its address
    /// (`10.1.2.3/24`), so that the destination can refuse before anything
    /// is frozen.
    Hello {
        /// The address that moves with the process, with its prefix length.
        address: String,
        /// The process's name and pid, for the destination's log.
        process: String,
        /// The source's pid space ([`super::host::pid_space`]): a
        /// destination in the same one cannot restore the process while
        /// its frozen original holds the pids there, and refuses.
        pid_space: String,
        /// A post-copy move (`--lazy-pages`): its pages stream
        /// ([`STREAM_PAGES`]) comes too, and the destination waits for it
        /// before it places the images (in memory) and starts its
        /// lazy-pages daemon early. One byte, 1 or 0, always present
        /// (version 2 of the stream; version 1 had none).
        lazy: bool,
    },
    /// Destination → source: it can host the process (what it will use).
    Ready {
        /// E.g. `CRIU 4.1.1, eth0`.
        detail: String,
    },
    /// Source → destination: an image file of `size` bytes follows as
    /// [`Frame::Data`] frames.
    File {
        /// The file's name in the images directory (no `/`).
        name: String,
        /// Its length in bytes.
        size: u64,
    },
    /// Source → destination: the next bytes of the current file.
    Data(Vec<u8>),
    /// Source → destination: whole image files at once, (name, contents)
    /// each — the many small images (one per socket) travel a frame per
    /// megabyte instead of two frames per file.
    Files(Vec<(String, Vec<u8>)>),
    /// Source → destination: every image was sent.
    Sent,
    /// Destination → source: every image is written here: the source may
    /// let its process go.
    Stored,
    /// Source → destination, before [`Frame::Restore`] or
    /// [`Frame::RestoreLazy`] when the process has any: its established TCP
    /// connections over loopback (its end, the peer's). Both ends of one
    /// are restored at the destination, one after the other, and CRIU sends
    /// a rebuilt socket's unsent data at once: the destination drops their
    /// packets until the restore is complete (else they draw a reset from
    /// the end not yet rebuilt, or land in it half-built).
    Loopback(Vec<(SocketAddr, SocketAddr)>),
    /// Source → destination: the process is gone at the source; restore it.
    Restore,
    /// Source → destination (post-copy, `--lazy-pages`): the process is
    /// still frozen at the source, its memory not in the images; restore it
    /// now with its memory fetched on demand over the pages stream
    /// ([`STREAM_PAGES`]), which the source opened before the dump.
    RestoreLazy,
    /// Destination → source: the process runs there, still behind the
    /// destination's address lock.
    Restored {
        /// The restored process's pid.
        pid: i32,
        /// How long CRIU's restore took, in microseconds.
        restore_us: u64,
    },
    /// Source → destination: packets that arrived for the process at the
    /// source during the freeze, to re-inject once the address is live.
    Packets(Vec<Vec<u8>>),
    /// Source → destination: the source has let go of the process and its
    /// address; take the address live.
    Commit,
    /// Destination → source: the address is live at the destination (lock
    /// lifted, captured packets re-injected, neighbours told).
    Live {
        /// Packets re-injected.
        reinjected: u64,
    },
    /// Source → destination: the migration is called off; undo everything.
    Abort {
        /// Why.
        reason: String,
    },
    /// Destination → source: the destination cannot go on; it has undone
    /// its part.
    Failed {
        /// Why, precisely.
        reason: String,
    },
}

/// Kind bytes, source → destination.
const HELLO: u8 = 1;
const FILE: u8 = 2;
const DATA: u8 = 3;
const SENT: u8 = 4;
const COMMIT: u8 = 5;
const ABORT: u8 = 6;
const RESTORE: u8 = 7;
const PACKETS: u8 = 8;
const RESTORE_LAZY: u8 = 9;
// 10 was `SKIP` (a hole in an image file), never sent since the lazy dump:
// an unknown kind now.
const FILES: u8 = 11;
const LOOPBACK: u8 = 12;
/// Kind bytes, destination → source.
const READY: u8 = 16;
const RESTORED: u8 = 17;
const LIVE: u8 = 18;
const FAILED: u8 = 19;
const STORED: u8 = 20;

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WireError {
    /// An unknown kind byte.
    UnknownKind(u8),
    /// A payload longer than [`MAX_PAYLOAD`].
    TooLong(usize),
    /// A payload that does not match its kind.
    Malformed {
        /// The frame's kind byte.
        kind: u8,
        /// What is wrong.
        detail: &'static str,
    },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::UnknownKind(k) => write!(f, "unknown frame kind {k}"),
            WireError::TooLong(n) => {
                write!(f, "a frame of {n} bytes (at most {MAX_PAYLOAD} allowed)")
            }
            WireError::Malformed { kind, detail } => {
                write!(f, "malformed frame of kind {kind}: {detail}")
            }
        }
    }
}

/// Checks a frame header: its kind and payload length.
pub(crate) fn header(h: &[u8; HEADER]) -> Result<(u8, usize), WireError> {
    let kind = h[0];
    if !matches!(
        kind,
        HELLO
            | FILE
            | DATA
            | SENT
            | COMMIT
            | ABORT
            | RESTORE
            | RESTORE_LAZY
            | FILES
            | LOOPBACK
            | PACKETS
            | READY
            | RESTORED
            | LIVE
            | FAILED
            | STORED
    ) {
        return Err(WireError::UnknownKind(kind));
    }
    let len = u32::from_be_bytes([h[1], h[2], h[3], h[4]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(WireError::TooLong(len));
    }
    Ok((kind, len))
}

/// Reads a payload's fields in order.
struct Fields<'a> {
    kind: u8,
    rest: &'a [u8],
}

impl<'a> Fields<'a> {
    fn bad(&self, detail: &'static str) -> WireError {
        WireError::Malformed {
            kind: self.kind,
            detail,
        }
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        if self.rest.len() < n {
            return Err(self.bad(what));
        }
        let (a, b) = self.rest.split_at(n);
        self.rest = b;
        Ok(a)
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        let b = self.take(8, "truncated number")?;
        Ok(u64::from_be_bytes(
            b.try_into().map_err(|_| self.bad("truncated number"))?,
        ))
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        let b = self.take(4, "truncated length")?;
        Ok(u32::from_be_bytes(
            b.try_into().map_err(|_| self.bad("truncated length"))?,
        ))
    }

    fn string(&mut self) -> Result<String, WireError> {
        let l = self.take(2, "truncated string length")?;
        let n = usize::from(u16::from_be_bytes([l[0], l[1]]));
        let b = self.take(n, "truncated string")?;
        String::from_utf8(b.to_vec()).map_err(|_| self.bad("a string that is not UTF-8"))
    }

    fn end(self) -> Result<(), WireError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(self.bad("bytes after the last field"))
        }
    }
}

/// Whether `name` may be an image file's name: a plain name in one
/// directory (nothing that could reach outside it).
fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name != "."
        && name != ".."
        && !name.contains(['/', '\0'])
}

/// Decodes the payload of a frame of `kind` (as [`header`] accepted it).
pub(crate) fn decode(kind: u8, payload: &[u8]) -> Result<Frame, WireError> {
    let mut f = Fields {
        kind,
        rest: payload,
    };
    let frame = match kind {
        HELLO => Frame::Hello {
            address: f.string()?,
            process: f.string()?,
            pid_space: f.string()?,
            lazy: match f.take(1, "no post-copy flag")?[0] {
                0 => false,
                1 => true,
                _ => return Err(f.bad("a post-copy flag that is neither 0 nor 1")),
            },
        },
        READY => Frame::Ready {
            detail: f.string()?,
        },
        FILE => {
            let size = f.u64()?;
            let name = f.string()?;
            if !plain_name(&name) {
                return Err(f.bad("an image file name that is not a plain file name"));
            }
            Frame::File { name, size }
        }
        DATA => {
            if payload.is_empty() {
                return Err(f.bad("an empty data frame"));
            }
            return Ok(Frame::Data(payload.to_vec()));
        }
        FILES => {
            let mut files = Vec::new();
            while !f.rest.is_empty() {
                let name = f.string()?;
                if !plain_name(&name) {
                    return Err(f.bad("an image file name that is not a plain file name"));
                }
                let len = f.u32()? as usize;
                let bytes = f.take(len, "a truncated file")?.to_vec();
                files.push((name, bytes));
            }
            if files.is_empty() {
                return Err(f.bad("no file"));
            }
            Frame::Files(files)
        }
        LOOPBACK => {
            let mut conns = Vec::new();
            while !f.rest.is_empty() {
                let mut end = || -> Result<SocketAddr, WireError> {
                    let s = f.string()?;
                    s.parse::<SocketAddr>()
                        .ok()
                        .filter(|a| a.ip().is_loopback())
                        .ok_or_else(|| f.bad("an endpoint that is not a loopback address and port"))
                };
                let ours = end()?;
                let peer = end()?;
                conns.push((ours, peer));
            }
            if conns.is_empty() {
                return Err(f.bad("no connection"));
            }
            Frame::Loopback(conns)
        }
        SENT => Frame::Sent,
        STORED => Frame::Stored,
        RESTORE => Frame::Restore,
        RESTORE_LAZY => Frame::RestoreLazy,
        RESTORED => {
            let pid = f.u64()?;
            let pid = i32::try_from(pid)
                .ok()
                .filter(|&p| p > 0)
                .ok_or_else(|| f.bad("a pid out of range"))?;
            Frame::Restored {
                pid,
                restore_us: f.u64()?,
            }
        }
        PACKETS => {
            return super::packets::unpack(payload)
                .filter(|p| !p.is_empty())
                .map(Frame::Packets)
                .ok_or_else(|| f.bad("malformed packets"))
        }
        COMMIT => Frame::Commit,
        LIVE => Frame::Live {
            reinjected: f.u64()?,
        },
        ABORT => Frame::Abort {
            reason: f.string()?,
        },
        FAILED => Frame::Failed {
            reason: f.string()?,
        },
        k => return Err(WireError::UnknownKind(k)),
    };
    f.end()?;
    Ok(frame)
}

/// Appends `s` as a string field (cut at a character boundary to fit).
fn put_string(out: &mut Vec<u8>, s: &str) {
    let mut end = s.len().min(usize::from(u16::MAX));
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&u16::try_from(end).unwrap_or(u16::MAX).to_be_bytes());
    out.extend_from_slice(&s.as_bytes()[..end]);
}

/// Bytes a file takes in a [`Frame::Files`] payload besides its contents.
pub(crate) fn files_entry_overhead(name: &str) -> usize {
    2 + name.len() + 4
}

/// Encodes a frame, header included. (A [`Frame::Data`], [`Frame::Files`]
/// or [`Frame::Packets`] longer than [`MAX_PAYLOAD`], or a packet longer
/// than 65,535 bytes, is the caller's bug: senders cut them to fit, as
/// [`super::packets::pack`] does.)
pub(crate) fn encode(frame: &Frame) -> Vec<u8> {
    let mut p = Vec::new();
    let kind = match frame {
        Frame::Hello {
            address,
            process,
            pid_space,
            lazy,
        } => {
            put_string(&mut p, address);
            put_string(&mut p, process);
            put_string(&mut p, pid_space);
            p.push(u8::from(*lazy));
            HELLO
        }
        Frame::Ready { detail } => {
            put_string(&mut p, detail);
            READY
        }
        Frame::File { name, size } => {
            p.extend_from_slice(&size.to_be_bytes());
            put_string(&mut p, name);
            FILE
        }
        Frame::Data(d) => {
            p.extend_from_slice(d);
            DATA
        }
        Frame::Files(files) => {
            for (name, bytes) in files {
                put_string(&mut p, name);
                p.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(0).to_be_bytes());
                p.extend_from_slice(bytes);
            }
            FILES
        }
        Frame::Loopback(conns) => {
            for (ours, peer) in conns {
                put_string(&mut p, &ours.to_string());
                put_string(&mut p, &peer.to_string());
            }
            LOOPBACK
        }
        Frame::Sent => SENT,
        Frame::Stored => STORED,
        Frame::Restore => RESTORE,
        Frame::RestoreLazy => RESTORE_LAZY,
        Frame::Restored { pid, restore_us } => {
            p.extend_from_slice(&u64::try_from(*pid).unwrap_or(0).to_be_bytes());
            p.extend_from_slice(&restore_us.to_be_bytes());
            RESTORED
        }
        Frame::Packets(ps) => {
            for q in ps {
                p.extend_from_slice(&u16::try_from(q.len()).unwrap_or(0).to_be_bytes());
                p.extend_from_slice(q);
            }
            PACKETS
        }
        Frame::Commit => COMMIT,
        Frame::Live { reinjected } => {
            p.extend_from_slice(&reinjected.to_be_bytes());
            LIVE
        }
        Frame::Abort { reason } => {
            put_string(&mut p, reason);
            ABORT
        }
        Frame::Failed { reason } => {
            put_string(&mut p, reason);
            FAILED
        }
    };
    let mut out = Vec::with_capacity(HEADER + p.len());
    out.push(kind);
    out.extend_from_slice(&u32::try_from(p.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(&p);
    out
}

/// Decodes every whole frame at the start of `bytes`: each frame and the
/// bytes it was decoded from. Stops at the first invalid frame (its error)
/// or at an incomplete one (the frames so far).
pub(crate) fn decode_all(mut bytes: &[u8]) -> Result<Vec<(Frame, &[u8])>, WireError> {
    let mut out = Vec::new();
    while bytes.len() >= HEADER {
        let h: [u8; HEADER] = bytes[..HEADER].try_into().unwrap_or([0; HEADER]);
        let (kind, len) = header(&h)?;
        if bytes.len() < HEADER + len {
            break;
        }
        let frame = decode(kind, &bytes[HEADER..HEADER + len])?;
        out.push((frame, &bytes[..HEADER + len]));
        bytes = &bytes[HEADER + len..];
    }
    Ok(out)
}

/// Reads one frame from `r`; an invalid frame is an `InvalidData` error.
pub(crate) async fn read_frame(r: &mut (impl AsyncRead + Unpin)) -> std::io::Result<Frame> {
    let mut h = [0u8; HEADER];
    r.read_exact(&mut h).await?;
    let invalid =
        |e: WireError| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string());
    let (kind, len) = header(&h).map_err(invalid)?;
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await?;
    decode(kind, &payload).map_err(invalid)
}

/// Writes one frame to `w` and flushes it.
pub(crate) async fn write_frame(
    w: &mut (impl AsyncWrite + Unpin),
    frame: &Frame,
) -> std::io::Result<()> {
    w.write_all(&encode(frame)).await?;
    w.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Frame> {
        vec![
            Frame::Hello {
                address: "10.1.2.3/24".into(),
                process: "1234 (redis-server)".into(),
                pid_space: "5f1c2b4e-0000-4000-8000-000000000001/4026531836".into(),
                lazy: true,
            },
            Frame::Hello {
                address: String::new(),
                process: "1 (init)".into(),
                pid_space: String::new(),
                lazy: false,
            },
            Frame::Ready {
                detail: "CRIU 4.1.1, eth0".into(),
            },
            Frame::File {
                name: "pages-1.img".into(),
                size: 1 << 33,
            },
            Frame::Data(vec![7; 100]),
            Frame::Files(vec![
                ("tcp-stream-1.img".into(), vec![1; 90]),
                ("empty.img".into(), Vec::new()),
            ]),
            Frame::Sent,
            Frame::Stored,
            Frame::Loopback(vec![
                (
                    "127.0.0.1:42218".parse().unwrap(),
                    "127.0.0.1:7100".parse().unwrap(),
                ),
                (
                    "[::1]:7100".parse().unwrap(),
                    "[::1]:50000".parse().unwrap(),
                ),
            ]),
            Frame::Restore,
            Frame::RestoreLazy,
            Frame::Restored {
                pid: 4321,
                restore_us: 123_456,
            },
            Frame::Packets(vec![vec![0x45; 40], vec![1, 2, 3]]),
            Frame::Commit,
            Frame::Live { reinjected: 17 },
            Frame::Abort {
                reason: "interrupted".into(),
            },
            Frame::Failed {
                reason: "No space left on device".into(),
            },
        ]
    }

    #[test]
    fn every_frame_round_trips_alone_and_in_a_row() {
        let mut row = Vec::new();
        for f in all() {
            let b = encode(&f);
            let h: [u8; HEADER] = b[..HEADER].try_into().unwrap();
            let (kind, len) = header(&h).unwrap();
            assert_eq!(len, b.len() - HEADER);
            assert_eq!(decode(kind, &b[HEADER..]).unwrap(), f);
            row.extend_from_slice(&b);
        }
        let back: Vec<Frame> = decode_all(&row)
            .unwrap()
            .into_iter()
            .map(|(f, _)| f)
            .collect();
        assert_eq!(back, all());
        // A cut anywhere yields the whole frames before it, never an error.
        for cut in 0..row.len() {
            let got = decode_all(&row[..cut]).unwrap();
            assert!(got.len() < all().len());
        }
    }

    #[test]
    fn names_that_could_leave_the_images_directory_are_refused() {
        for name in ["", ".", "..", "../etc/passwd", "a/b", "x\0y"] {
            let b = encode(&Frame::File {
                name: name.into(),
                size: 1,
            });
            assert!(
                matches!(decode(FILE, &b[HEADER..]), Err(WireError::Malformed { .. })),
                "{name:?} accepted"
            );
        }
    }

    #[test]
    fn another_version_of_the_stream_is_named_and_refused() {
        let why = other_version(b"roam:migrate-process/1").expect("version 1 is refused");
        assert!(
            why.contains("version 1") && why.contains("this destination 2"),
            "{why}"
        );
        assert_eq!(other_version(STREAM_META), None);
        assert_eq!(other_version(STREAM_PAGES), None);
        assert_eq!(other_version(b"roam-store/1"), None, "not a migration");
    }

    #[test]
    fn bad_headers_and_payloads_are_precise_errors() {
        assert_eq!(header(&[99, 0, 0, 0, 0]), Err(WireError::UnknownKind(99)));
        assert_eq!(
            header(&[DATA, 0, 0x10, 0, 1]),
            Err(WireError::TooLong((1 << 20) + 1))
        );
        assert!(decode(DATA, &[]).is_err());
        assert!(decode(FILES, &[]).is_err(), "no file");
        assert!(
            decode(FILES, &[0, 1, b'a', 0, 0, 0, 2, 0]).is_err(),
            "a file shorter than its length"
        );
        assert!(
            decode(FILES, &[0, 2, b'.', b'.', 0, 0, 0, 0]).is_err(),
            "a name leaving the directory"
        );
        assert!(decode(COMMIT, &[0]).is_err(), "trailing bytes");
        assert!(decode(RESTORED, &[0; 16]).is_err(), "pid 0");
        assert!(decode(HELLO, &[0, 5, b'a']).is_err(), "truncated string");
        let mut p = Vec::new();
        for _ in 0..3 {
            put_string(&mut p, "x");
        }
        assert!(decode(HELLO, &p).is_err(), "no flag (version 1's HELLO)");
        p.push(2);
        assert!(decode(HELLO, &p).is_err(), "a flag of 2");
        p.pop();
        p.extend_from_slice(&[1, 0]);
        assert!(decode(HELLO, &p).is_err(), "a byte after the flag");
        assert!(decode(READY, &[0, 1, 0xff]).is_err(), "not UTF-8");
        assert!(decode(LOOPBACK, &[]).is_err(), "no connection");
        let mut p = Vec::new();
        put_string(&mut p, "127.0.0.1:1");
        put_string(&mut p, "10.0.0.1:2");
        assert!(decode(LOOPBACK, &p).is_err(), "a peer not on loopback");
        let mut p = Vec::new();
        put_string(&mut p, "127.0.0.1:1");
        assert!(decode(LOOPBACK, &p).is_err(), "no peer");
        put_string(&mut p, "127.0.0.1:2");
        assert!(decode(LOOPBACK, &p).is_ok(), "one connection");
    }
}
