//! The shell stream's wire format (`roam shell` ↔ `roam serve --shell`).
//!
//! The stream's metadata is `roam-shell/1 ` followed by a JSON [`Open`]
//! request. Both directions then carry frames: a kind byte, a payload
//! length (u32, little-endian, at most [`MAX_FRAME`]) and the payload.
//!
//! | kind | direction | payload |
//! |---:|---|---|
//! | 1 `Input` | client → server | bytes typed |
//! | 2 `Resize` | client → server | rows u16, cols u16 (LE) |
//! | 3 `Output` | server → client | terminal output |
//! | 4 `Attached` | server → client | JSON: the shell's name, and whether it is new |
//! | 5 `Exit` | server → client | the shell's exit status, i32 LE (-1: killed by a signal) |
//! | 6 `Error` | server → client | why the shell was refused (UTF-8) |
//! | 7 `Reattach` | server → client | empty: the relay is being upgraded; open a new shell stream with the same name (its screen comes without the scrollback) |

use serde::{Deserialize, Serialize};

/// What starts a shell stream's metadata.
pub(crate) const META_PREFIX: &[u8] = b"roam-shell/1 ";
/// Largest frame payload.
pub(crate) const MAX_FRAME: usize = 1 << 20;
/// The `Exit` status of a shell whose status is not known: it was handed
/// over by another relay, its parent.
pub(crate) const EXIT_UNKNOWN: i32 = i32::MIN;

/// The client's request, in the stream's metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Open {
    /// The account to run the shell as.
    pub(crate) user: String,
    /// The shell to attach to or create under this name; `None`: a new one.
    pub(crate) name: Option<String>,
    /// `$TERM` for the shell.
    pub(crate) term: String,
    /// The client's window size.
    pub(crate) rows: u16,
    pub(crate) cols: u16,
    /// Whether a re-attach sends the scrollback before the screen (not when
    /// the client re-attaches after a relay upgrade: it has it).
    #[serde(default = "yes")]
    pub(crate) scrollback: bool,
}

fn yes() -> bool {
    true
}

impl Open {
    /// The stream metadata carrying this request.
    pub(crate) fn meta(&self) -> Vec<u8> {
        let mut m = META_PREFIX.to_vec();
        m.extend_from_slice(&serde_json::to_vec(self).expect("an Open always serializes"));
        m
    }

    /// `None` if `meta` is no shell request (a TCP target); else the request
    /// or why it is malformed.
    pub(crate) fn parse(meta: &[u8]) -> Option<Result<Self, String>> {
        let json = meta.strip_prefix(META_PREFIX)?;
        Some(
            serde_json::from_slice::<Open>(json)
                .map_err(|e| format!("malformed shell request: {e}"))
                .and_then(|o| {
                    if o.rows == 0 || o.cols == 0 {
                        Err("malformed shell request: a window of 0 rows or columns".into())
                    } else {
                        Ok(o)
                    }
                }),
        )
    }
}

/// The `Attached` frame's payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Attached {
    /// The shell's name (generated for a new unnamed shell).
    pub(crate) name: String,
    /// `true` if the shell was started for this request.
    pub(crate) new: bool,
}

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Frame {
    Input(Vec<u8>),
    Resize { rows: u16, cols: u16 },
    Output(Vec<u8>),
    Attached(Attached),
    Exit(i32),
    Error(String),
    Reattach,
}

impl Frame {
    /// Appends the frame's bytes to `out`.
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        let (kind, payload): (u8, std::borrow::Cow<'_, [u8]>) = match self {
            Frame::Input(b) => (1, b.as_slice().into()),
            Frame::Resize { rows, cols } => {
                let mut p = rows.to_le_bytes().to_vec();
                p.extend_from_slice(&cols.to_le_bytes());
                (2, p.into())
            }
            Frame::Output(b) => (3, b.as_slice().into()),
            Frame::Attached(a) => (
                4,
                serde_json::to_vec(a)
                    .expect("Attached always serializes")
                    .into(),
            ),
            Frame::Exit(code) => (5, code.to_le_bytes().to_vec().into()),
            Frame::Error(e) => (6, e.as_bytes().into()),
            Frame::Reattach => (7, Vec::new().into()),
        };
        out.push(kind);
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&payload);
    }
}

/// `kind | payload length u32 LE | payload` frames as their bytes arrive:
/// the framing of the shell stream and of a shell worker's control socket.
#[derive(Debug, Default)]
pub(crate) struct Framing {
    buf: Vec<u8>,
}

impl Framing {
    /// Adds received bytes.
    pub(crate) fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next whole frame's kind and payload, `None` until it is whole;
    /// an error (naming the frames `what`) for a payload over `max` bytes.
    pub(crate) fn take(&mut self, max: usize, what: &str) -> Result<Option<(u8, Vec<u8>)>, String> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let kind = self.buf[0];
        let len = u32::from_le_bytes(self.buf[1..5].try_into().expect("4 bytes")) as usize;
        if len > max {
            return Err(format!("{what} of {len} bytes is over the limit"));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        let payload: Vec<u8> = self.buf[5..5 + len].to_vec();
        self.buf.drain(..5 + len);
        Ok(Some((kind, payload)))
    }
}

/// Splits a byte stream into frames.
#[derive(Debug, Default)]
pub(crate) struct Decoder {
    frames: Framing,
}

impl Decoder {
    /// Adds received bytes.
    pub(crate) fn push(&mut self, data: &[u8]) {
        self.frames.push(data);
    }

    /// The next complete frame, `None` if more bytes are needed, or why the
    /// bytes are not a frame (the stream is then unusable).
    pub(crate) fn next(&mut self) -> Result<Option<Frame>, String> {
        let Some((kind, payload)) = self.frames.take(MAX_FRAME, "shell frame")? else {
            return Ok(None);
        };
        let len = payload.len();
        let frame = match kind {
            1 => Frame::Input(payload),
            2 if len == 4 => Frame::Resize {
                rows: u16::from_le_bytes([payload[0], payload[1]]),
                cols: u16::from_le_bytes([payload[2], payload[3]]),
            },
            3 => Frame::Output(payload),
            4 => Frame::Attached(
                serde_json::from_slice(&payload).map_err(|e| format!("shell frame: {e}"))?,
            ),
            5 if len == 4 => Frame::Exit(i32::from_le_bytes(
                payload[..4].try_into().expect("4 bytes"),
            )),
            6 => Frame::Error(String::from_utf8_lossy(&payload).into_owned()),
            7 if len == 0 => Frame::Reattach,
            k => return Err(format!("unknown shell frame kind {k} of {len} bytes")),
        };
        Ok(Some(frame))
    }
}

/// Decodes every frame in `bytes` and re-encodes them (for the fuzz target):
/// the re-encoding must decode to the same frames.
pub(crate) fn reencode(bytes: &[u8]) -> Result<Vec<u8>, String> {
    let mut d = Decoder::default();
    d.push(bytes);
    let mut out = Vec::new();
    while let Some(f) = d.next()? {
        f.encode(&mut out);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_in_any_split() {
        let frames = vec![
            Frame::Input(b"ls\r".to_vec()),
            Frame::Resize {
                rows: 50,
                cols: 132,
            },
            Frame::Output(vec![0x1b, b'[', b'H']),
            Frame::Attached(Attached {
                name: "work".into(),
                new: true,
            }),
            Frame::Exit(-1),
            Frame::Error("no".into()),
            Frame::Reattach,
        ];
        let mut bytes = Vec::new();
        for f in &frames {
            f.encode(&mut bytes);
        }
        for split in 0..bytes.len() {
            let mut d = Decoder::default();
            let mut got = Vec::new();
            for part in [&bytes[..split], &bytes[split..]] {
                d.push(part);
                while let Some(f) = d.next().unwrap() {
                    got.push(f);
                }
            }
            assert_eq!(got, frames, "split at {split}");
        }
    }

    #[test]
    fn bad_frames_and_requests_are_named() {
        let mut d = Decoder::default();
        d.push(&[9, 0, 0, 0, 0]);
        assert!(d.next().unwrap_err().contains("unknown shell frame kind 9"));
        let mut d = Decoder::default();
        d.push(&[1, 0xff, 0xff, 0xff, 0xff]);
        assert!(d.next().unwrap_err().contains("over the limit"));
        assert!(Open::parse(b"127.0.0.1:22").is_none());
        assert!(Open::parse(b"roam-shell/1 {").unwrap().is_err());
        let zero = Open {
            user: "u".into(),
            name: None,
            term: "xterm".into(),
            rows: 0,
            cols: 80,
            scrollback: true,
        };
        assert!(Open::parse(&zero.meta()).unwrap().is_err());
        let ok = Open { rows: 24, ..zero };
        assert_eq!(Open::parse(&ok.meta()).unwrap().unwrap(), ok);
    }
}
