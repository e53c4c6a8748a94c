//! The host-to-host messages of a move (`docs/PROTOCOL.md` §14.3), in
//! today's form of the Migrate paper's Fig. 9: an offer with the session's
//! compatibility vector (SESSION_TRANSFER_REQUEST + COMPATIBILITY_CHECK),
//! pre-copied attributes, the final transfer (SERVICE_MIGRATE), commit
//! (CLEAR_TO_MIGRATE), abort, and the answers. Plus the operator's requests
//! (status, move, drain).
//!
//! Each message is one `type` byte and its fields; strings and byte strings
//! are varint-length-prefixed with the caps below. [`Msg::decode`] takes
//! exactly one message and refuses trailing bytes. The `cluster` fuzz
//! target round-trips it.

use std::collections::BTreeMap;

use roam_proto::codec::{put_lp_bytes, put_varint, DecodeError, Reader};
use roam_proto::SessionId;

/// Longest name (service, property, host, attribute) in a message.
pub const MAX_NAME: usize = 255;
/// Longest property value or reason text in a message.
pub const MAX_TEXT: usize = 4096;
/// Most properties, attributes or sessions in one message.
pub const MAX_ITEMS: usize = 65_536;
/// Largest byte string in a message: a continuation's body or an
/// attribute (the link carries messages up to this size plus headers).
pub const MAX_BLOB: usize = 64 << 20;

/// Why a destination refused an offer or a transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The session's compatibility vector does not hold here: `property`
    /// (or `service`/`routine` for those) is missing or differs.
    Incompatible {
        /// What differs: a property name, or "service" / "routine".
        property: String,
        /// The value the session requires.
        required: String,
        /// This host's value, if any.
        found: Option<String>,
    },
    /// This host already holds a newer state of the session (its
    /// ownership revision is at least the offered one): the offer is stale.
    Stale {
        /// The revision this host knows.
        known: u64,
    },
    /// The destination cannot take it now (store failed, shutting down,
    /// no offer matches the transfer); the text says which.
    Unavailable(String),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Incompatible {
                property,
                required,
                found: Some(v),
            } => write!(
                f,
                "incompatible: {property} is {v:?} there, the session requires {required:?}"
            ),
            Self::Incompatible {
                property,
                required,
                found: None,
            } => write!(
                f,
                "incompatible: {property} is missing there, the session requires {required:?}"
            ),
            Self::Stale { known } => {
                write!(f, "stale: the destination knows revision {known} already")
            }
            Self::Unavailable(why) => write!(f, "destination unavailable: {why}"),
        }
    }
}

/// One session in a host's status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRow {
    /// The session.
    pub id: SessionId,
    /// Its service.
    pub service: String,
    /// "live", "suspended", "frozen", "moving", "incoming".
    pub state: String,
}

/// A host-to-host (or operator-to-host) message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// Source → destination: "may I move this session to you?" with its
    /// compatibility vector (service, routine, required properties) and the
    /// ownership revision the move would create.
    Offer {
        /// The session.
        id: SessionId,
        /// Its service.
        service: String,
        /// The routine it will resume with, if already known.
        routine: Option<String>,
        /// Properties it requires (always `version`).
        requires: BTreeMap<String, String>,
        /// The revision the destination will own it under.
        revision: u64,
    },
    /// Destination → source: the offer is accepted; the destination now
    /// waits for the transfer (and holds resumes of the session meanwhile).
    Accept,
    /// Destination → source: refused, and why.
    Refuse(Refusal),
    /// Source → destination: attributes copied while the session still runs
    /// at the source (pre-copy); the transfer sends only what changed since.
    /// Answered `Accept` once kept (or refused if no offer is pending).
    Precopy {
        /// The session.
        id: SessionId,
        /// Attribute values as of now.
        attrs: BTreeMap<String, Vec<u8>>,
    },
    /// Source → destination: the frozen session. `meta` and `body` are a
    /// continuation record (the body zstd-compressed); attributes unchanged
    /// since the pre-copy travel with empty values and are named in
    /// `precopied`: the destination takes their values from the pre-copy.
    Transfer {
        /// The session.
        id: SessionId,
        /// The ownership revision (as offered).
        revision: u64,
        /// The record's meta entry.
        meta: Vec<u8>,
        /// The record's compressed body.
        body: Vec<u8>,
        /// Attributes whose values come from the pre-copy.
        precopied: Vec<String>,
    },
    /// Destination → source: the transfer decoded and checked; it will serve
    /// the session once told to commit.
    Installed,
    /// Source → destination: the source has let go (it redirects the
    /// session's client to the destination from now on): serve it.
    Commit {
        /// The session.
        id: SessionId,
        /// The revision.
        revision: u64,
    },
    /// Destination → source: committed and stored durably.
    Committed,
    /// Source → destination: the move is off; forget what was sent and send
    /// the session's client back to the source.
    Abort {
        /// The session.
        id: SessionId,
    },
    /// Operator → host: list the sessions held.
    Status,
    /// Host → operator: this host's name and sessions.
    StatusReply {
        /// The host's name in the cluster.
        host: String,
        /// Its sessions.
        sessions: Vec<SessionRow>,
    },
    /// Operator → host: move one session to host `to`.
    Move {
        /// The session.
        id: SessionId,
        /// The destination host's name.
        to: String,
    },
    /// Operator → host: move every session off this host (to the others,
    /// least loaded first), then answer.
    Drain,
    /// Host → operator: a request finished: sessions moved and failures.
    Done {
        /// Sessions moved.
        moved: u64,
        /// Why each failed move failed (empty on full success).
        failures: Vec<String>,
    },
}

const OFFER: u8 = 1;
const ACCEPT: u8 = 2;
const REFUSE: u8 = 3;
const PRECOPY: u8 = 4;
const TRANSFER: u8 = 5;
const INSTALLED: u8 = 6;
const COMMIT: u8 = 7;
const COMMITTED: u8 = 8;
const ABORT: u8 = 9;
const STATUS: u8 = 10;
const STATUS_REPLY: u8 = 11;
const MOVE: u8 = 12;
const DRAIN: u8 = 13;
const DONE: u8 = 14;

fn put_text(out: &mut Vec<u8>, s: &str) {
    put_lp_bytes(out, s.as_bytes());
}

fn text(r: &mut Reader<'_>, max: usize, field: &'static str) -> Result<String, DecodeError> {
    let b = r.lp_bytes(max, field)?;
    String::from_utf8(b.to_vec()).map_err(|_| DecodeError::InvalidValue(field))
}

fn put_map_text(out: &mut Vec<u8>, m: &BTreeMap<String, String>) {
    put_varint(out, m.len() as u64);
    for (k, v) in m {
        put_text(out, k);
        put_text(out, v);
    }
}

fn map_text(r: &mut Reader<'_>) -> Result<BTreeMap<String, String>, DecodeError> {
    let n = r.varint_usize(MAX_ITEMS, "property count")?;
    let mut m = BTreeMap::new();
    for _ in 0..n {
        let k = text(r, MAX_NAME, "property name")?;
        let v = text(r, MAX_TEXT, "property value")?;
        if m.insert(k, v).is_some() {
            return Err(DecodeError::InvalidValue("duplicate property"));
        }
    }
    Ok(m)
}

fn id(r: &mut Reader<'_>) -> Result<SessionId, DecodeError> {
    Ok(SessionId(r.array()?))
}

impl Msg {
    /// Appends the encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Self::Offer {
                id,
                service,
                routine,
                requires,
                revision,
            } => {
                out.push(OFFER);
                out.extend_from_slice(&id.0);
                put_text(out, service);
                match routine {
                    Some(r) => {
                        out.push(1);
                        put_text(out, r);
                    }
                    None => out.push(0),
                }
                put_map_text(out, requires);
                put_varint(out, *revision);
            }
            Self::Accept => out.push(ACCEPT),
            Self::Refuse(r) => {
                out.push(REFUSE);
                match r {
                    Refusal::Incompatible {
                        property,
                        required,
                        found,
                    } => {
                        out.push(1);
                        put_text(out, property);
                        put_text(out, required);
                        match found {
                            Some(f) => {
                                out.push(1);
                                put_text(out, f);
                            }
                            None => out.push(0),
                        }
                    }
                    Refusal::Stale { known } => {
                        out.push(2);
                        put_varint(out, *known);
                    }
                    Refusal::Unavailable(why) => {
                        out.push(3);
                        put_text(out, why);
                    }
                }
            }
            Self::Precopy { id, attrs } => {
                out.push(PRECOPY);
                out.extend_from_slice(&id.0);
                put_varint(out, attrs.len() as u64);
                for (k, v) in attrs {
                    put_text(out, k);
                    put_lp_bytes(out, v);
                }
            }
            Self::Transfer {
                id,
                revision,
                meta,
                body,
                precopied,
            } => {
                out.push(TRANSFER);
                out.extend_from_slice(&id.0);
                put_varint(out, *revision);
                put_lp_bytes(out, meta);
                put_lp_bytes(out, body);
                put_varint(out, precopied.len() as u64);
                for n in precopied {
                    put_text(out, n);
                }
            }
            Self::Installed => out.push(INSTALLED),
            Self::Commit { id, revision } => {
                out.push(COMMIT);
                out.extend_from_slice(&id.0);
                put_varint(out, *revision);
            }
            Self::Committed => out.push(COMMITTED),
            Self::Abort { id } => {
                out.push(ABORT);
                out.extend_from_slice(&id.0);
            }
            Self::Status => out.push(STATUS),
            Self::StatusReply { host, sessions } => {
                out.push(STATUS_REPLY);
                put_text(out, host);
                put_varint(out, sessions.len() as u64);
                for s in sessions {
                    out.extend_from_slice(&s.id.0);
                    put_text(out, &s.service);
                    put_text(out, &s.state);
                }
            }
            Self::Move { id, to } => {
                out.push(MOVE);
                out.extend_from_slice(&id.0);
                put_text(out, to);
            }
            Self::Drain => out.push(DRAIN),
            Self::Done { moved, failures } => {
                out.push(DONE);
                put_varint(out, *moved);
                put_varint(out, failures.len() as u64);
                for f in failures {
                    put_text(out, f);
                }
            }
        }
    }

    /// The encoding as a new vector.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.encode(&mut v);
        v
    }

    /// Decodes exactly one message from `buf`.
    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(buf);
        let msg = match r.u8()? {
            OFFER => {
                let id = id(&mut r)?;
                let service = text(&mut r, MAX_NAME, "service")?;
                let routine = match r.u8()? {
                    0 => None,
                    1 => Some(text(&mut r, MAX_NAME, "routine")?),
                    _ => return Err(DecodeError::InvalidValue("routine flag")),
                };
                let requires = map_text(&mut r)?;
                let revision = r.varint()?;
                Self::Offer {
                    id,
                    service,
                    routine,
                    requires,
                    revision,
                }
            }
            ACCEPT => Self::Accept,
            REFUSE => Self::Refuse(match r.u8()? {
                1 => {
                    let property = text(&mut r, MAX_NAME, "property")?;
                    let required = text(&mut r, MAX_TEXT, "required value")?;
                    let found = match r.u8()? {
                        0 => None,
                        1 => Some(text(&mut r, MAX_TEXT, "found value")?),
                        _ => return Err(DecodeError::InvalidValue("found flag")),
                    };
                    Refusal::Incompatible {
                        property,
                        required,
                        found,
                    }
                }
                2 => Refusal::Stale { known: r.varint()? },
                3 => Refusal::Unavailable(text(&mut r, MAX_TEXT, "reason")?),
                _ => return Err(DecodeError::InvalidValue("refusal kind")),
            }),
            PRECOPY => {
                let id = id(&mut r)?;
                let n = r.varint_usize(MAX_ITEMS, "attribute count")?;
                let mut attrs = BTreeMap::new();
                for _ in 0..n {
                    let k = text(&mut r, MAX_NAME, "attribute name")?;
                    let v = r.lp_bytes(MAX_BLOB, "attribute value")?.to_vec();
                    if attrs.insert(k, v).is_some() {
                        return Err(DecodeError::InvalidValue("duplicate attribute"));
                    }
                }
                Self::Precopy { id, attrs }
            }
            TRANSFER => {
                let id = id(&mut r)?;
                let revision = r.varint()?;
                let meta = r.lp_bytes(MAX_BLOB, "meta")?.to_vec();
                let body = r.lp_bytes(MAX_BLOB, "body")?.to_vec();
                let n = r.varint_usize(MAX_ITEMS, "pre-copied count")?;
                let mut precopied = Vec::with_capacity(n.min(64));
                for _ in 0..n {
                    precopied.push(text(&mut r, MAX_NAME, "pre-copied attribute")?);
                }
                Self::Transfer {
                    id,
                    revision,
                    meta,
                    body,
                    precopied,
                }
            }
            INSTALLED => Self::Installed,
            COMMIT => Self::Commit {
                id: id(&mut r)?,
                revision: r.varint()?,
            },
            COMMITTED => Self::Committed,
            ABORT => Self::Abort { id: id(&mut r)? },
            STATUS => Self::Status,
            STATUS_REPLY => {
                let host = text(&mut r, MAX_NAME, "host")?;
                let n = r.varint_usize(MAX_ITEMS, "session count")?;
                let mut sessions = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    sessions.push(SessionRow {
                        id: id(&mut r)?,
                        service: text(&mut r, MAX_NAME, "service")?,
                        state: text(&mut r, MAX_NAME, "state")?,
                    });
                }
                Self::StatusReply { host, sessions }
            }
            MOVE => Self::Move {
                id: id(&mut r)?,
                to: text(&mut r, MAX_NAME, "host")?,
            },
            DRAIN => Self::Drain,
            DONE => {
                let moved = r.varint()?;
                let n = r.varint_usize(MAX_ITEMS, "failure count")?;
                let mut failures = Vec::with_capacity(n.min(64));
                for _ in 0..n {
                    failures.push(text(&mut r, MAX_TEXT, "failure")?);
                }
                Self::Done { moved, failures }
            }
            _ => return Err(DecodeError::InvalidValue("cluster message type")),
        };
        r.finish()?;
        Ok(msg)
    }
}

/// Fuzzing only (the `cluster` fuzz target): decoding never panics, and a
/// decoded message re-encodes to bytes that decode to the same message and
/// re-encode identically.
#[cfg(fuzzing)]
pub fn fuzz_round_trip(data: &[u8]) {
    if let Ok(m) = Msg::decode(data) {
        let once = m.to_bytes();
        let again = Msg::decode(&once).expect("a re-encoded message decodes");
        assert_eq!(again, m, "decode(encode(m)) == m");
        assert_eq!(again.to_bytes(), once, "the encoding is canonical");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Msg> {
        let id = SessionId([7; 16]);
        let mut requires = BTreeMap::new();
        requires.insert("version".to_string(), "2".to_string());
        let mut attrs = BTreeMap::new();
        attrs.insert("offset".to_string(), vec![1, 2, 3]);
        vec![
            Msg::Offer {
                id,
                service: "files".into(),
                routine: Some("send".into()),
                requires: requires.clone(),
                revision: 3,
            },
            Msg::Offer {
                id,
                service: "files".into(),
                routine: None,
                requires,
                revision: 0,
            },
            Msg::Accept,
            Msg::Refuse(Refusal::Incompatible {
                property: "version".into(),
                required: "2".into(),
                found: Some("1".into()),
            }),
            Msg::Refuse(Refusal::Incompatible {
                property: "gpu".into(),
                required: "yes".into(),
                found: None,
            }),
            Msg::Refuse(Refusal::Stale { known: 9 }),
            Msg::Refuse(Refusal::Unavailable("disk full".into())),
            Msg::Precopy { id, attrs },
            Msg::Transfer {
                id,
                revision: 4,
                meta: vec![1; 40],
                body: vec![2; 300],
                precopied: vec!["old".into()],
            },
            Msg::Installed,
            Msg::Commit { id, revision: 4 },
            Msg::Committed,
            Msg::Abort { id },
            Msg::Status,
            Msg::StatusReply {
                host: "a".into(),
                sessions: vec![SessionRow {
                    id,
                    service: "files".into(),
                    state: "live".into(),
                }],
            },
            Msg::Move { id, to: "b".into() },
            Msg::Drain,
            Msg::Done {
                moved: 64,
                failures: vec!["x: refused".into()],
            },
        ]
    }

    #[test]
    fn every_message_round_trips_and_truncations_fail() {
        for m in samples() {
            let b = m.to_bytes();
            assert_eq!(Msg::decode(&b).unwrap(), m);
            for n in 0..b.len() {
                assert!(Msg::decode(&b[..n]).is_err(), "{m:?} cut at {n}");
            }
            let mut long = b.clone();
            long.push(0);
            assert!(Msg::decode(&long).is_err(), "{m:?} with a trailing byte");
        }
    }

    #[test]
    fn unknown_types_and_flags_are_refused() {
        assert!(Msg::decode(&[0]).is_err());
        assert!(Msg::decode(&[200]).is_err());
        assert!(Msg::decode(&[REFUSE, 9]).is_err());
    }
}
