//! Fuzzing only: compiled under `cfg(fuzzing)`, which cargo-fuzz sets and no
//! normal build does, for the `etcd_client` fuzz target. It reaches the
//! decoders of network input (the HTTP response reader, base64, the JSON
//! answers) without making them part of the crate's API, and encodes typed
//! answers the way the gateway does so the target can check round trips.

use std::time::Duration;

use serde_json::{json, Map, Value};

use crate::{b64, http, Error, KeyValue, Lease, OpResponse, TxnResponse};

/// The largest response the reader accepts in this build (small under
/// `cfg(fuzzing)`, so inputs reach it).
pub const MAX_RESPONSE: usize = http::MAX_RESPONSE;

/// What the response reader answered, comparable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The response is incomplete.
    NeedMore,
    /// A whole response.
    Response {
        /// Its status.
        status: u16,
        /// Its body, de-chunked.
        body: Vec<u8>,
    },
    /// The connection ended too soon (the error's text).
    Io(String),
    /// Not HTTP/1.1 as expected, or over a limit (the error's text).
    Protocol(String),
}

fn answer(r: Result<Option<http::Response>, http::HttpError>) -> Answer {
    match r {
        Ok(None) => Answer::NeedMore,
        Ok(Some(r)) => Answer::Response {
            status: r.status,
            body: r.body,
        },
        Err(http::HttpError::Io(e)) => Answer::Io(format!("{:?}: {e}", e.kind())),
        Err(http::HttpError::Protocol(m)) => Answer::Protocol(m),
        Err(http::HttpError::Connect(e)) => unreachable!("the reader made a connection: {e}"),
    }
}

/// The HTTP response reader `post` uses.
#[derive(Debug)]
pub struct ResponseReader(http::ResponseReader);

impl Default for ResponseReader {
    fn default() -> Self {
        ResponseReader(http::ResponseReader::new())
    }
}

impl ResponseReader {
    /// Takes received bytes.
    pub fn push(&mut self, data: &[u8]) -> Answer {
        answer(self.0.push(data))
    }

    /// The connection closed.
    pub fn finish(self) -> Answer {
        answer(self.0.finish().map(Some))
    }
}

/// Standard base64 with padding, as requests carry keys and values.
pub fn b64_encode(data: &[u8]) -> String {
    b64::encode(data)
}

/// The base64 decoder of keys and values in answers.
pub fn b64_decode(text: &str) -> Result<Vec<u8>, String> {
    b64::decode(text)
}

/// A gateway answer decoded by each call's decoder.
#[derive(Debug)]
pub struct Answers {
    /// `get` / `get_prefix`.
    pub range: Result<Vec<KeyValue>, Error>,
    /// `put`.
    pub put: Result<i64, Error>,
    /// `delete`.
    pub delete: Result<u64, Error>,
    /// `txn`.
    pub txn: Result<TxnResponse, Error>,
    /// `grant`.
    pub grant: Result<Lease, Error>,
    /// `keep_alive_once`.
    pub keep_alive: Result<Option<Duration>, Error>,
}

/// Decodes `body`, received with `status`, as every call would: the outer
/// error is the one every call answers (etcd's error, not JSON, not an
/// object), the fields each call's own answer.
pub fn decode_answers(status: u16, body: &[u8]) -> Result<Answers, Error> {
    let response = http::Response {
        status,
        body: body.to_vec(),
    };
    let m = crate::decode_answer("http://fuzz", "/v3/fuzz", response)?;
    Ok(Answers {
        range: crate::decode_range(&m),
        put: crate::decode_put(&m),
        delete: crate::decode_delete(&m),
        txn: crate::decode_txn(&m),
        grant: crate::decode_grant(&m),
        keep_alive: crate::decode_keep_alive(&m),
    })
}

// ---- answers as the gateway writes them: int64 as strings, zero values omitted ----

fn header(revision: i64) -> Value {
    json!({ "cluster_id": "14841639068965178418", "member_id": "10276657743932975437",
            "revision": revision.to_string(), "raft_term": "2" })
}

fn kv_json(kv: &KeyValue) -> Value {
    let mut m = Map::new();
    let mut bytes = |name: &str, b: &[u8]| {
        if !b.is_empty() {
            m.insert(name.into(), Value::String(b64::encode(b)));
        }
    };
    bytes("key", &kv.key);
    bytes("value", &kv.value);
    for (name, n) in [
        ("create_revision", kv.create_revision),
        ("mod_revision", kv.mod_revision),
        ("version", kv.version),
        ("lease", kv.lease),
    ] {
        if n != 0 {
            m.insert(name.into(), Value::String(n.to_string()));
        }
    }
    Value::Object(m)
}

fn kvs_json(kvs: &[KeyValue]) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("header".into(), header(1));
    if !kvs.is_empty() {
        m.insert("kvs".into(), kvs.iter().map(kv_json).collect());
        m.insert("count".into(), Value::String(kvs.len().to_string()));
    }
    m
}

fn body(v: Value) -> Vec<u8> {
    v.to_string().into_bytes()
}

/// A range answer holding `kvs`.
pub fn encode_range(kvs: &[KeyValue]) -> Vec<u8> {
    body(Value::Object(kvs_json(kvs)))
}

/// A put's answer.
pub fn encode_put(revision: i64) -> Vec<u8> {
    body(json!({ "header": header(revision) }))
}

/// A delete's answer.
pub fn encode_delete(deleted: u64) -> Vec<u8> {
    if deleted == 0 {
        body(json!({ "header": header(1) }))
    } else {
        body(json!({ "header": header(1), "deleted": deleted.to_string() }))
    }
}

/// A transaction's answer.
pub fn encode_txn(txn: &TxnResponse) -> Vec<u8> {
    let mut m = Map::new();
    m.insert("header".into(), header(txn.revision));
    if txn.succeeded {
        m.insert("succeeded".into(), Value::Bool(true));
    }
    if !txn.responses.is_empty() {
        let responses = txn
            .responses
            .iter()
            .map(|r| match r {
                OpResponse::Put => json!({ "response_put": { "header": header(txn.revision) } }),
                OpResponse::Delete(0) => {
                    json!({ "response_delete_range": { "header": header(txn.revision) } })
                }
                OpResponse::Delete(n) => json!({ "response_delete_range": {
                    "header": header(txn.revision), "deleted": n.to_string() } }),
                OpResponse::Get(kvs) => json!({ "response_range": kvs_json(kvs) }),
            })
            .collect();
        m.insert("responses".into(), Value::Array(responses));
    }
    body(Value::Object(m))
}

/// A lease grant's answer.
pub fn encode_grant(lease: &Lease) -> Vec<u8> {
    let mut m = Map::new();
    m.insert("header".into(), header(1));
    m.insert("ID".into(), Value::String(lease.id.to_string()));
    if !lease.ttl.is_zero() {
        m.insert("TTL".into(), Value::String(lease.ttl.as_secs().to_string()));
    }
    body(Value::Object(m))
}

/// A keep-alive's streamed answer (`{"result": ...}`); `None` is a lease
/// that is gone (TTL omitted).
pub fn encode_keep_alive(ttl: Option<Duration>) -> Vec<u8> {
    let mut r = Map::new();
    r.insert("header".into(), header(1));
    r.insert("ID".into(), Value::String("7587878111111111111".into()));
    if let Some(ttl) = ttl {
        r.insert("TTL".into(), Value::String(ttl.as_secs().to_string()));
    }
    body(json!({ "result": r }))
}
