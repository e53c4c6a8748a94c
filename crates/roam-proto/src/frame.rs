//! Frames: the units carried inside encrypted records.
//!
//! Spec: `docs/PROTOCOL.md` §5 (frame table). Every frame starts with a varint
//! type code from [`FrameType`]; a record's plaintext is a sequence of whole frames.
//! Frames marked *reliable* are numbered by the session-level sequence (§7) and
//! retransmitted after a resume; the others belong to one transport only.

use crate::codec::{put_lp_bytes, put_varint, varint_len, DecodeError, Reader};

/// Longest stream metadata accepted (bytes), e.g. a relay target `host:port`.
pub const MAX_META_LEN: usize = 1024;
/// Longest close reason or address string (bytes).
pub const MAX_TEXT_LEN: usize = 1024;
/// Most addresses in one `ADDRESSES` frame.
pub const MAX_ADDRESSES: usize = 16;

/// Frame type codes (§5). One table; the codec and the spec follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameType {
    /// §5.1 Liveness probe; answered by `PONG`.
    Ping = 0x01,
    /// §5.1 Answer to `PING`, echoing its token.
    Pong = 0x02,
    /// §7.2 Cumulative acknowledgement of reliable frames.
    Ack = 0x03,
    /// §7.3 First frame on every transport: where each side's numbering stands.
    Sync = 0x04,
    /// §4.3 Server to client, once per new session: id and resume secret.
    SessionInfo = 0x05,
    /// §10 Graceful end of the session (reliable).
    Close = 0x06,
    /// §9.1 Addresses the server may be reached at (reliable).
    Addresses = 0x07,
    /// §9.2 Ask the client to move to an address (reliable).
    MoveTo = 0x08,
    /// §9.4 The client asks to be moved to another host (reliable).
    MoveAsk = 0x09,
    /// §6.1 A new stream with its metadata (reliable).
    Open = 0x10,
    /// §6.2 Stream bytes (reliable).
    Data = 0x11,
    /// §6.2 Stream bytes that end the sender's direction (reliable).
    DataFin = 0x12,
    /// §6.4 Abort a stream in both directions (reliable).
    Reset = 0x13,
    /// §8 Raise one stream's receive limit (reliable).
    MaxStreamData = 0x14,
    /// §8 Raise the session-wide receive limit (reliable).
    MaxData = 0x15,
    /// §6.5 Raise the total number of streams the peer may open (reliable).
    MaxStreams = 0x16,
}

impl FrameType {
    fn from_code(code: u64) -> Result<Self, DecodeError> {
        Ok(match code {
            0x01 => Self::Ping,
            0x02 => Self::Pong,
            0x03 => Self::Ack,
            0x04 => Self::Sync,
            0x05 => Self::SessionInfo,
            0x06 => Self::Close,
            0x07 => Self::Addresses,
            0x08 => Self::MoveTo,
            0x09 => Self::MoveAsk,
            0x10 => Self::Open,
            0x11 => Self::Data,
            0x12 => Self::DataFin,
            0x13 => Self::Reset,
            0x14 => Self::MaxStreamData,
            0x15 => Self::MaxData,
            0x16 => Self::MaxStreams,
            other => return Err(DecodeError::UnknownFrameType(other)),
        })
    }
}

/// One decoded frame, borrowing variable-length fields from the record.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)] // fields are documented in docs/PROTOCOL.md §5
pub enum Frame<'a> {
    Ping {
        token: u64,
    },
    Pong {
        token: u64,
    },
    Ack {
        received: u64,
    },
    Sync {
        received: u64,
        next: u64,
    },
    SessionInfo {
        session_id: [u8; 16],
        resume_secret: [u8; 32],
        resume_timeout_secs: u64,
    },
    Close {
        code: u64,
        reason: &'a [u8],
    },
    Addresses {
        addrs: Vec<&'a [u8]>,
    },
    MoveTo {
        addr: &'a [u8],
    },
    MoveAsk {
        host: &'a [u8],
    },
    Open {
        stream: u64,
        meta: &'a [u8],
    },
    Data {
        stream: u64,
        offset: u64,
        fin: bool,
        data: &'a [u8],
    },
    Reset {
        stream: u64,
        code: u64,
    },
    MaxStreamData {
        stream: u64,
        max: u64,
    },
    MaxData {
        max: u64,
    },
    MaxStreams {
        max: u64,
    },
}

impl<'a> Frame<'a> {
    /// Whether the frame is numbered and retransmitted across transports (§7).
    pub fn is_reliable(&self) -> bool {
        !matches!(
            self,
            Frame::Ping { .. }
                | Frame::Pong { .. }
                | Frame::Ack { .. }
                | Frame::Sync { .. }
                | Frame::SessionInfo { .. }
        )
    }

    /// Decodes one frame from the front of `r`.
    pub fn decode(r: &mut Reader<'a>) -> Result<Self, DecodeError> {
        let ty = FrameType::from_code(r.varint()?)?;
        Ok(match ty {
            FrameType::Ping => Frame::Ping { token: r.varint()? },
            FrameType::Pong => Frame::Pong { token: r.varint()? },
            FrameType::Ack => Frame::Ack {
                received: r.varint()?,
            },
            FrameType::Sync => Frame::Sync {
                received: r.varint()?,
                next: r.varint()?,
            },
            FrameType::SessionInfo => Frame::SessionInfo {
                session_id: r.array()?,
                resume_secret: r.array()?,
                resume_timeout_secs: r.varint()?,
            },
            FrameType::Close => Frame::Close {
                code: r.varint()?,
                reason: r.lp_bytes(MAX_TEXT_LEN, "close reason")?,
            },
            FrameType::Addresses => {
                let n = r.varint_usize(MAX_ADDRESSES, "address count")?;
                let mut addrs = Vec::with_capacity(n);
                for _ in 0..n {
                    addrs.push(r.lp_bytes(MAX_TEXT_LEN, "address")?);
                }
                Frame::Addresses { addrs }
            }
            FrameType::MoveTo => Frame::MoveTo {
                addr: r.lp_bytes(MAX_TEXT_LEN, "address")?,
            },
            FrameType::MoveAsk => Frame::MoveAsk {
                host: r.lp_bytes(MAX_TEXT_LEN, "host name")?,
            },
            FrameType::Open => Frame::Open {
                stream: r.varint()?,
                meta: r.lp_bytes(MAX_META_LEN, "stream metadata")?,
            },
            FrameType::Data | FrameType::DataFin => {
                let stream = r.varint()?;
                let offset = r.varint()?;
                let len = r.varint_usize(usize::MAX, "data length")?;
                let data = r.bytes(len)?;
                if offset
                    .checked_add(len as u64)
                    .is_none_or(|end| end > crate::codec::VARINT_MAX)
                {
                    return Err(DecodeError::InvalidValue("data offset"));
                }
                Frame::Data {
                    stream,
                    offset,
                    fin: ty == FrameType::DataFin,
                    data,
                }
            }
            FrameType::Reset => Frame::Reset {
                stream: r.varint()?,
                code: r.varint()?,
            },
            FrameType::MaxStreamData => Frame::MaxStreamData {
                stream: r.varint()?,
                max: r.varint()?,
            },
            FrameType::MaxData => Frame::MaxData { max: r.varint()? },
            FrameType::MaxStreams => Frame::MaxStreams { max: r.varint()? },
        })
    }

    /// Appends the encoding of this frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Frame::Ping { token } => put2(out, FrameType::Ping, *token),
            Frame::Pong { token } => put2(out, FrameType::Pong, *token),
            Frame::Ack { received } => put2(out, FrameType::Ack, *received),
            Frame::Sync { received, next } => {
                put2(out, FrameType::Sync, *received);
                put_varint(out, *next);
            }
            Frame::SessionInfo {
                session_id,
                resume_secret,
                resume_timeout_secs,
            } => {
                put_varint(out, FrameType::SessionInfo as u64);
                out.extend_from_slice(session_id);
                out.extend_from_slice(resume_secret);
                put_varint(out, *resume_timeout_secs);
            }
            Frame::Close { code, reason } => {
                put2(out, FrameType::Close, *code);
                put_lp_bytes(out, reason);
            }
            Frame::Addresses { addrs } => {
                put2(out, FrameType::Addresses, addrs.len() as u64);
                for a in addrs {
                    put_lp_bytes(out, a);
                }
            }
            Frame::MoveTo { addr } => {
                put_varint(out, FrameType::MoveTo as u64);
                put_lp_bytes(out, addr);
            }
            Frame::MoveAsk { host } => {
                put_varint(out, FrameType::MoveAsk as u64);
                put_lp_bytes(out, host);
            }
            Frame::Open { stream, meta } => {
                put2(out, FrameType::Open, *stream);
                put_lp_bytes(out, meta);
            }
            Frame::Data {
                stream,
                offset,
                fin,
                data,
            } => {
                encode_data_header(out, *stream, *offset, data.len(), *fin);
                out.extend_from_slice(data);
            }
            Frame::Reset { stream, code } => {
                put2(out, FrameType::Reset, *stream);
                put_varint(out, *code);
            }
            Frame::MaxStreamData { stream, max } => {
                put2(out, FrameType::MaxStreamData, *stream);
                put_varint(out, *max);
            }
            Frame::MaxData { max } => put2(out, FrameType::MaxData, *max),
            Frame::MaxStreams { max } => put2(out, FrameType::MaxStreams, *max),
        }
    }
}

fn put2(out: &mut Vec<u8>, ty: FrameType, v: u64) {
    put_varint(out, ty as u64);
    put_varint(out, v);
}

/// Writes a `DATA`/`DATA_FIN` header; the caller appends `len` payload bytes right
/// after it (this is how the sender copies payload straight from its stream
/// buffer into the record it encrypts in place, without an intermediate frame).
pub fn encode_data_header(out: &mut Vec<u8>, stream: u64, offset: u64, len: usize, fin: bool) {
    let ty = if fin {
        FrameType::DataFin
    } else {
        FrameType::Data
    };
    put_varint(out, ty as u64);
    put_varint(out, stream);
    put_varint(out, offset);
    put_varint(out, len as u64);
}

/// Upper bound of a `DATA` header's size for these fields.
pub fn data_header_len(stream: u64, offset: u64, len: usize) -> usize {
    1 + varint_len(stream) + varint_len(offset) + varint_len(len as u64)
}

/// Decodes every frame of a record plaintext, calling `f` for each. Stops at the
/// first malformed frame.
pub fn for_each_frame<'a>(
    plaintext: &'a [u8],
    mut f: impl FnMut(Frame<'a>) -> Result<(), crate::Error>,
) -> Result<(), crate::Error> {
    let mut r = Reader::new(plaintext);
    while r.remaining() > 0 {
        let frame = Frame::decode(&mut r).map_err(crate::Error::Decode)?;
        f(frame)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn round_trip(f: &Frame<'_>) {
        let mut out = Vec::new();
        f.encode(&mut out);
        let mut r = Reader::new(&out);
        let back = Frame::decode(&mut r).unwrap();
        assert_eq!(&back, f);
        r.finish().unwrap();
        // Every strict prefix is a short read, never a panic or a different frame.
        for cut in 0..out.len() {
            assert!(Frame::decode(&mut Reader::new(&out[..cut])).is_err());
        }
    }

    #[test]
    fn test_vectors_match_spec() {
        // docs/PROTOCOL.md §5.5 lists these exact bytes.
        let cases: [(Frame<'_>, &str); 4] = [
            (Frame::Ping { token: 7 }, "0107"),
            (
                Frame::Sync {
                    received: 300,
                    next: 5,
                },
                "04412c05",
            ),
            (
                Frame::Open {
                    stream: 4,
                    meta: b"127.0.0.1:22",
                },
                "10040c3132372e302e302e313a3232",
            ),
            (
                Frame::Data {
                    stream: 4,
                    offset: 0,
                    fin: true,
                    data: b"hi",
                },
                "1204000268 69",
            ),
        ];
        for (frame, hexs) in cases {
            let mut out = Vec::new();
            frame.encode(&mut out);
            assert_eq!(hex::encode(&out), hexs.replace(' ', ""), "{frame:?}");
            round_trip(&frame);
        }
    }

    #[test]
    fn unknown_type_is_named() {
        assert_eq!(
            Frame::decode(&mut Reader::new(&[0x3f])),
            Err(DecodeError::UnknownFrameType(0x3f))
        );
    }

    #[test]
    fn oversized_metadata_rejected() {
        let mut out = Vec::new();
        Frame::Open {
            stream: 0,
            meta: &[b'a'; MAX_META_LEN + 1],
        }
        .encode(&mut out);
        assert_eq!(
            Frame::decode(&mut Reader::new(&out)),
            Err(DecodeError::InvalidValue("stream metadata"))
        );
    }

    fn arb_bytes() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), 0..64)
    }

    proptest! {
        #[test]
        fn frames_round_trip(
            a in 0..crate::codec::VARINT_MAX / 2,
            b in 0..crate::codec::VARINT_MAX / 2,
            bytes in arb_bytes(),
            id in any::<[u8; 16]>(),
            secret in any::<[u8; 32]>(),
            fin in any::<bool>(),
        ) {
            round_trip(&Frame::Ping { token: a });
            round_trip(&Frame::Pong { token: a });
            round_trip(&Frame::Ack { received: a });
            round_trip(&Frame::Sync { received: a, next: b });
            round_trip(&Frame::SessionInfo { session_id: id, resume_secret: secret, resume_timeout_secs: b });
            round_trip(&Frame::Close { code: a, reason: &bytes });
            round_trip(&Frame::Addresses { addrs: vec![&bytes, b"10.0.0.1:7447"] });
            round_trip(&Frame::MoveTo { addr: &bytes });
            round_trip(&Frame::MoveAsk { host: &bytes });
            round_trip(&Frame::Open { stream: a, meta: &bytes });
            round_trip(&Frame::Data { stream: a, offset: b, fin, data: &bytes });
            round_trip(&Frame::Reset { stream: a, code: b });
            round_trip(&Frame::MaxStreamData { stream: a, max: b });
            round_trip(&Frame::MaxData { max: a });
            round_trip(&Frame::MaxStreams { max: b });
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = for_each_frame(&bytes, |_| Ok(()));
        }
    }
}
