//! A small async etcd v3 client over etcd's JSON gRPC gateway.
//!
//! Every call is an HTTP/1.1 `POST` of a JSON body to `/v3/...` (etcd 3.4
//! serves the gateway there, on the client port). The gateway's JSON follows
//! protobuf's JSON mapping: `bytes` fields (keys, values) are base64, `int64`
//! fields are JSON strings, and fields holding their zero value are *omitted*
//! from answers (`succeeded` is absent when false, `kvs` when empty, `value`
//! when empty, `TTL` when 0). The decoder here treats an absent field as its
//! zero value and accepts numbers as well as strings for integers.
//!
//! # Transport
//!
//! The HTTP client is a minimal hand-written one on a tokio [`TcpStream`]
//! (module `http`, private): one connection per request with
//! `Connection: close`, answers framed by `Content-Length`, `chunked` (the
//! gateway streams `lease/keepalive` that way) or the end of the connection.
//! Chosen over hyper because the gateway needs nothing more (plain HTTP, JSON,
//! small bodies), it adds no dependency beyond `serde_json` and `tokio`
//! (hyper, hyper-util, http, http-body-util and their trees would all be new
//! to the workspace), and it makes the failure modes explicit: a connect error
//! (nothing sent: the next endpoint is tried) is told apart from an error
//! after the request went out (not retried, as it may have been applied).
//! A connection per request costs one loopback/LAN handshake, which is small
//! next to an etcd write (a raft round and an fsync).
//!
//! The response is read sans-IO: `http::ResponseReader` holds no socket
//! (bytes are pushed in as they arrive; it answers "need more", the response
//! or an error, the same however the bytes were split), and the JSON answers
//! are decoded by plain functions of the body. The `etcd_client` fuzz target
//! drives both, and base64, through the module `fuzzing`, which exists only
//! under `cfg(fuzzing)` (set by cargo-fuzz, never by a normal build).
//!
//! # Errors
//!
//! Nothing here panics on bad input: an endpoint that does not answer is
//! [`Error::Unreachable`], an error from etcd (any non-200 status, or an
//! `error` field in the answer) is [`Error::Server`] with etcd's own message,
//! an answer that does not decode is [`Error::Decode`], and a request that
//! outlives [`Client::with_timeout`] is [`Error::Timeout`].
//!
//! [`TcpStream`]: tokio::net::TcpStream

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Map, Value};

mod b64;
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing;
mod http;
pub mod testing;

/// A lease's id, as etcd assigns it. `0` means "no lease".
pub type LeaseId = i64;

/// Why a request failed.
#[derive(Debug)]
pub enum Error {
    /// No endpoint answered (all of them tried); carries the last io error text and endpoints.
    /// Also used for an endpoint that cannot be used at all (e.g. `https://`),
    /// and for a connection that failed after the request was sent.
    Unreachable(String),
    /// etcd answered with an error (HTTP status + etcd's message, e.g. "etcdserver: requested lease not found").
    Server {
        /// The HTTP status of the answer (e.g. 404 for an unknown lease, 400
        /// for an invalid argument); the gateway's `http_code` for an error
        /// inside a streamed answer.
        status: u16,
        /// etcd's message, verbatim.
        message: String,
    },
    /// The answer could not be decoded (what and why).
    Decode(String),
    /// A request exceeded `Client::timeout`; carries the operation's name
    /// (e.g. `"put"`).
    Timeout(&'static str),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Unreachable(msg) => write!(f, "etcd unreachable: {msg}"),
            Error::Server { status, message } => {
                write!(f, "etcd error (HTTP {status}): {message}")
            }
            Error::Decode(msg) => write!(f, "undecodable etcd answer: {msg}"),
            Error::Timeout(op) => write!(f, "etcd request timed out: {op}"),
        }
    }
}

impl std::error::Error for Error {}

/// A key and its value with etcd's metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    /// The key.
    pub key: Vec<u8>,
    /// The value (empty if the value is empty).
    pub value: Vec<u8>,
    /// The revision of the key's last creation.
    pub create_revision: i64,
    /// The revision of the key's last modification.
    pub mod_revision: i64,
    /// How many times the key was written since its creation (1 after the first put).
    pub version: i64,
    /// The lease the key is attached to, `0` for none.
    pub lease: LeaseId,
}

/// A comparison operator in a [`Compare`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmpOp {
    /// The key's attribute equals the operand.
    Equal,
    /// The key's attribute differs from the operand.
    NotEqual,
    /// The key's attribute is greater than the operand.
    Greater,
    /// The key's attribute is less than the operand.
    Less,
}

impl CmpOp {
    fn json(self) -> &'static str {
        match self {
            CmpOp::Equal => "EQUAL",
            CmpOp::NotEqual => "NOT_EQUAL",
            CmpOp::Greater => "GREATER",
            CmpOp::Less => "LESS",
        }
    }
}

/// A guard of a [`Txn`]: `key`'s attribute compared with an operand.
#[derive(Clone, Debug)]
pub enum Compare {
    /// The key's version (0 = absent).
    Version(Vec<u8>, CmpOp, i64),
    /// The key's modification revision (0 = absent).
    ModRevision(Vec<u8>, CmpOp, i64),
    /// The key's value. etcd treats a comparison on an absent key's value as false.
    Value(Vec<u8>, CmpOp, Vec<u8>),
    /// The key's lease (0 = none).
    Lease(Vec<u8>, CmpOp, LeaseId),
}

impl Compare {
    fn json(&self) -> Value {
        match self {
            Compare::Version(k, op, v) => json!({
                "key": b64::encode(k), "result": op.json(), "target": "VERSION",
                "version": v.to_string(),
            }),
            Compare::ModRevision(k, op, r) => json!({
                "key": b64::encode(k), "result": op.json(), "target": "MOD",
                "mod_revision": r.to_string(),
            }),
            Compare::Value(k, op, v) => json!({
                "key": b64::encode(k), "result": op.json(), "target": "VALUE",
                "value": b64::encode(v),
            }),
            Compare::Lease(k, op, l) => json!({
                "key": b64::encode(k), "result": op.json(), "target": "LEASE",
                "lease": l.to_string(),
            }),
        }
    }
}

/// An operation in a [`Txn`] branch.
#[derive(Clone, Debug)]
pub enum Op {
    /// Writes `key = value`, attached to `lease` (0 = none).
    Put {
        /// The key.
        key: Vec<u8>,
        /// The value.
        value: Vec<u8>,
        /// The lease to attach the key to, 0 for none.
        lease: LeaseId,
    },
    /// Deletes `key` (its answer says how many keys went: 0 or 1).
    Delete {
        /// The key.
        key: Vec<u8>,
    },
    /// Reads `key`.
    Get {
        /// The key.
        key: Vec<u8>,
    },
}

impl Op {
    fn json(&self) -> Value {
        match self {
            Op::Put { key, value, lease } => {
                json!({ "request_put": put_body(key, value, *lease) })
            }
            Op::Delete { key } => json!({ "request_delete_range": { "key": b64::encode(key) } }),
            Op::Get { key } => json!({ "request_range": { "key": b64::encode(key) } }),
        }
    }
}

/// An atomic transaction: if every `compare` holds, `success` runs, else `failure`.
#[derive(Clone, Debug, Default)]
pub struct Txn {
    /// The guards, all of which must hold for `success` to run.
    pub compare: Vec<Compare>,
    /// The operations run if every guard holds.
    pub success: Vec<Op>,
    /// The operations run otherwise.
    pub failure: Vec<Op>,
}

/// The answer to one [`Op`] of a transaction, in the branch's order.
#[derive(Clone, Debug)]
pub enum OpResponse {
    /// A put was applied.
    Put,
    /// A delete removed this many keys.
    Delete(u64),
    /// A get found these key-values (empty if the key is absent).
    Get(Vec<KeyValue>),
}

/// The answer to a [`Txn`].
#[derive(Clone, Debug)]
pub struct TxnResponse {
    /// Whether every guard held (the `success` branch ran).
    pub succeeded: bool,
    /// The store's revision after the transaction.
    pub revision: i64,
    /// One answer per operation of the branch that ran.
    pub responses: Vec<OpResponse>,
}

/// A granted lease.
#[derive(Clone, Copy, Debug)]
pub struct Lease {
    /// Its id.
    pub id: LeaseId,
    /// The TTL etcd granted (may exceed the one asked for: etcd has a minimum).
    pub ttl: Duration,
}

/// One endpoint, parsed.
#[derive(Debug)]
struct Endpoint {
    /// As given, for messages.
    url: String,
    /// `host:port` to connect to.
    addr: String,
}

#[derive(Debug)]
struct Inner {
    endpoints: Vec<Endpoint>,
    /// The index of the endpoint that answered last: requests start there.
    preferred: AtomicUsize,
}

/// An etcd client: cheap to clone (clones share the endpoints and the
/// preferred one), `Send + Sync`.
#[derive(Clone, Debug)]
pub struct Client {
    inner: Arc<Inner>,
    timeout: Duration,
}

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

fn parse_endpoint(raw: &str) -> Result<Endpoint, Error> {
    let trimmed = raw.trim();
    let rest = if let Some(r) = trimmed.strip_prefix("http://") {
        r
    } else if trimmed.contains("://") {
        return Err(Error::Unreachable(format!(
            "endpoint {raw:?}: only http:// is supported (no TLS)"
        )));
    } else {
        trimmed
    };
    let hostport = rest.split('/').next().unwrap_or("");
    if hostport.is_empty() {
        return Err(Error::Unreachable(format!("endpoint {raw:?}: no host")));
    }
    // A port is present if the part after the last ':' is digits and it is
    // not inside an IPv6 literal's brackets.
    let has_port = match hostport.rsplit_once(':') {
        Some((host, port)) => {
            !port.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit())
                && (!host.contains(':') || host.ends_with(']'))
        }
        None => false,
    };
    let addr = if has_port {
        hostport.to_string()
    } else {
        format!("{hostport}:2379")
    };
    Ok(Endpoint {
        url: raw.to_string(),
        addr,
    })
}

fn put_body(key: &[u8], value: &[u8], lease: LeaseId) -> Value {
    let mut m = Map::new();
    m.insert("key".into(), Value::String(b64::encode(key)));
    m.insert("value".into(), Value::String(b64::encode(value)));
    if lease != 0 {
        m.insert("lease".into(), Value::String(lease.to_string()));
    }
    Value::Object(m)
}

/// The smallest key greater than every key starting with `prefix`; `[0]`
/// (etcd's "to the end of the keyspace") if there is none.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

// ---- decoding helpers: absent means zero ----

fn dec_err(what: &str, why: impl fmt::Display) -> Error {
    Error::Decode(format!("{what}: {why}"))
}

fn obj<'a>(v: &'a Value, what: &str) -> Result<&'a Map<String, Value>, Error> {
    v.as_object()
        .ok_or_else(|| dec_err(what, format!("expected an object, got {}", short(v))))
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 200 {
        format!("{}...", s.chars().take(200).collect::<String>())
    } else {
        s
    }
}

fn get_i64(m: &Map<String, Value>, name: &str, what: &str) -> Result<i64, Error> {
    match m.get(name) {
        None | Some(Value::Null) => Ok(0),
        Some(Value::String(s)) => s
            .parse()
            .map_err(|e| dec_err(&format!("{what}.{name}"), format!("{s:?}: {e}"))),
        Some(Value::Number(n)) => n
            .as_i64()
            .ok_or_else(|| dec_err(&format!("{what}.{name}"), format!("{n} is not an int64"))),
        Some(v) => Err(dec_err(
            &format!("{what}.{name}"),
            format!("expected an int64, got {}", short(v)),
        )),
    }
}

fn get_bytes(m: &Map<String, Value>, name: &str, what: &str) -> Result<Vec<u8>, Error> {
    match m.get(name) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => b64::decode(s).map_err(|e| dec_err(&format!("{what}.{name}"), e)),
        Some(v) => Err(dec_err(
            &format!("{what}.{name}"),
            format!("expected base64, got {}", short(v)),
        )),
    }
}

fn get_bool(m: &Map<String, Value>, name: &str, what: &str) -> Result<bool, Error> {
    match m.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(dec_err(
            &format!("{what}.{name}"),
            format!("expected a bool, got {}", short(v)),
        )),
    }
}

/// The header's revision.
fn header_revision(m: &Map<String, Value>, what: &str) -> Result<i64, Error> {
    match m.get("header") {
        None | Some(Value::Null) => Ok(0),
        Some(h) => get_i64(obj(h, &format!("{what}.header"))?, "revision", what),
    }
}

fn decode_kv(v: &Value, what: &str) -> Result<KeyValue, Error> {
    let m = obj(v, what)?;
    Ok(KeyValue {
        key: get_bytes(m, "key", what)?,
        value: get_bytes(m, "value", what)?,
        create_revision: get_i64(m, "create_revision", what)?,
        mod_revision: get_i64(m, "mod_revision", what)?,
        version: get_i64(m, "version", what)?,
        lease: get_i64(m, "lease", what)?,
    })
}

fn decode_kvs(m: &Map<String, Value>, what: &str) -> Result<Vec<KeyValue>, Error> {
    match m.get("kvs") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, kv)| decode_kv(kv, &format!("{what}.kvs[{i}]")))
            .collect(),
        Some(v) => Err(dec_err(
            &format!("{what}.kvs"),
            format!("expected an array, got {}", short(v)),
        )),
    }
}

fn non_negative(n: i64, what: &str) -> Result<u64, Error> {
    u64::try_from(n).map_err(|_| dec_err(what, format!("negative count {n}")))
}

/// Looks a field up by its proto name or its lowerCamel JSON name.
fn either<'a>(m: &'a Map<String, Value>, proto: &str, camel: &str) -> Option<&'a Value> {
    m.get(proto).or_else(|| m.get(camel))
}

fn decode_op_response(v: &Value, what: &str) -> Result<OpResponse, Error> {
    let m = obj(v, what)?;
    if let Some(r) = either(m, "response_range", "responseRange") {
        let what = format!("{what}.response_range");
        return Ok(OpResponse::Get(decode_kvs(obj(r, &what)?, &what)?));
    }
    if let Some(r) = either(m, "response_put", "responsePut") {
        obj(r, &format!("{what}.response_put"))?;
        return Ok(OpResponse::Put);
    }
    if let Some(r) = either(m, "response_delete_range", "responseDeleteRange") {
        let what = format!("{what}.response_delete_range");
        let n = get_i64(obj(r, &what)?, "deleted", &what)?;
        return Ok(OpResponse::Delete(non_negative(n, &what)?));
    }
    Err(dec_err(
        what,
        format!(
            "no response_range, response_put or response_delete_range in {}",
            short(v)
        ),
    ))
}

// ---- the answers to each call, from the object `decode_answer` returns ----

/// A range's key-values (`get`, `get_prefix`).
fn decode_range(m: &Map<String, Value>) -> Result<Vec<KeyValue>, Error> {
    decode_kvs(m, "range")
}

/// A put's revision.
fn decode_put(m: &Map<String, Value>) -> Result<i64, Error> {
    header_revision(m, "put")
}

/// How many keys a delete removed.
fn decode_delete(m: &Map<String, Value>) -> Result<u64, Error> {
    non_negative(get_i64(m, "deleted", "deleterange")?, "deleterange.deleted")
}

/// A transaction's outcome and its branch's answers.
fn decode_txn(m: &Map<String, Value>) -> Result<TxnResponse, Error> {
    let responses = match m.get("responses") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, r)| decode_op_response(r, &format!("txn.responses[{i}]")))
            .collect::<Result<_, _>>()?,
        Some(v) => {
            return Err(dec_err(
                "txn.responses",
                format!("expected an array, got {}", short(v)),
            ))
        }
    };
    Ok(TxnResponse {
        succeeded: get_bool(m, "succeeded", "txn")?,
        revision: header_revision(m, "txn")?,
        responses,
    })
}

/// A granted lease; an answer without an ID is an error.
fn decode_grant(m: &Map<String, Value>) -> Result<Lease, Error> {
    let id = get_i64(m, "ID", "lease grant")?;
    let granted = get_i64(m, "TTL", "lease grant")?;
    if id == 0 {
        return Err(dec_err("lease grant", "no lease ID in the answer"));
    }
    Ok(Lease {
        id,
        ttl: Duration::from_secs(
            u64::try_from(granted)
                .map_err(|_| dec_err("lease grant.TTL", format!("negative TTL {granted}")))?,
        ),
    })
}

/// A keep-alive's remaining TTL, `None` if the lease is gone.
fn decode_keep_alive(m: &Map<String, Value>) -> Result<Option<Duration>, Error> {
    // A streamed answer: each message is wrapped in {"result": ...}.
    let r = match m.get("result") {
        Some(r) => obj(r, "keepalive.result")?,
        None => m,
    };
    let ttl = get_i64(r, "TTL", "keepalive")?;
    Ok(u64::try_from(ttl)
        .ok()
        .filter(|&t| t > 0)
        .map(Duration::from_secs))
}

/// An `error` in an answer (a unary error body, a streamed error, or a
/// response's own `error` string).
fn server_error(m: &Map<String, Value>, status: u16) -> Option<Error> {
    let message = |fallback: &str| -> String {
        match m.get("message") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            _ => fallback.to_string(),
        }
    };
    match m.get("error")? {
        Value::String(s) if s.is_empty() => None,
        Value::String(s) => Some(Error::Server {
            status,
            message: message(s),
        }),
        Value::Object(e) => {
            let msg = match e.get("message") {
                Some(Value::String(s)) => s.clone(),
                _ => Value::Object(e.clone()).to_string(),
            };
            let status = e
                .get("http_code")
                .and_then(Value::as_u64)
                .and_then(|c| u16::try_from(c).ok())
                .unwrap_or(status);
            Some(Error::Server {
                status,
                message: msg,
            })
        }
        Value::Null => None,
        other => Some(Error::Server {
            status,
            message: message(&other.to_string()),
        }),
    }
}

impl Client {
    /// endpoints like "http://127.0.0.1:2379" (also accept "127.0.0.1:2379"); checks one answers (POST /v3/maintenance/status). Requests go to the first endpoint that works; on a connection error the next endpoint is tried.
    ///
    /// A host without a port gets etcd's 2379. Only `http://` is supported;
    /// another scheme, an empty list or an endpoint without a host is
    /// [`Error::Unreachable`] with the reason. The check uses the default
    /// timeout (5 s).
    pub async fn connect(endpoints: &[String]) -> Result<Client, Error> {
        Self::connect_within(endpoints, DEFAULT_TIMEOUT).await
    }

    /// [`Client::connect`] with a given timeout for the check, which stays the
    /// client's timeout.
    pub(crate) async fn connect_within(
        endpoints: &[String],
        timeout: Duration,
    ) -> Result<Client, Error> {
        if endpoints.is_empty() {
            return Err(Error::Unreachable("no endpoints given".to_string()));
        }
        let endpoints = endpoints
            .iter()
            .map(|e| parse_endpoint(e))
            .collect::<Result<Vec<_>, _>>()?;
        let client = Client {
            inner: Arc::new(Inner {
                endpoints,
                preferred: AtomicUsize::new(0),
            }),
            timeout,
        };
        client
            .call("connect", "/v3/maintenance/status", json!({}))
            .await?;
        Ok(client)
    }

    /// Sets the per-request timeout (default 5 s): a request, including its
    /// tries of other endpoints, that takes longer is [`Error::Timeout`].
    pub fn with_timeout(self, d: Duration) -> Client {
        Client {
            inner: self.inner,
            timeout: d,
        }
    }

    /// The per-request timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sends one request within the timeout; decodes the JSON answer and
    /// turns etcd's errors into [`Error::Server`].
    async fn call(
        &self,
        op: &'static str,
        path: &str,
        body: Value,
    ) -> Result<Map<String, Value>, Error> {
        let body = body.to_string().into_bytes();
        match tokio::time::timeout(self.timeout, self.send(path, &body)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout(op)),
        }
    }

    async fn send(&self, path: &str, body: &[u8]) -> Result<Map<String, Value>, Error> {
        let eps = &self.inner.endpoints;
        let start = self.inner.preferred.load(Ordering::Relaxed) % eps.len();
        let mut failures = Vec::new();
        for i in 0..eps.len() {
            let idx = (start + i) % eps.len();
            let ep = &eps[idx];
            match http::post(&ep.addr, path, body).await {
                Ok(resp) => {
                    if idx != start {
                        self.inner.preferred.store(idx, Ordering::Relaxed);
                    }
                    return decode_answer(&ep.url, path, resp);
                }
                Err(http::HttpError::Connect(e)) => {
                    failures.push(format!("{}: {e}", ep.url));
                }
                Err(http::HttpError::Io(e)) => {
                    return Err(Error::Unreachable(format!(
                        "{} {path}: connection failed after the request was sent: {e}",
                        ep.url
                    )));
                }
                Err(http::HttpError::Protocol(e)) => {
                    return Err(Error::Decode(format!("{} {path}: {e}", ep.url)));
                }
            }
        }
        Err(Error::Unreachable(format!(
            "no endpoint answered {path} ({})",
            failures.join("; ")
        )))
    }

    /// Reads one key.
    pub async fn get(&self, key: &[u8]) -> Result<Option<KeyValue>, Error> {
        let m = self
            .call("get", "/v3/kv/range", json!({ "key": b64::encode(key) }))
            .await?;
        Ok(decode_range(&m)?.into_iter().next())
    }

    /// Reads every key starting with `prefix`, in key order (all keys if
    /// `prefix` is empty).
    pub async fn get_prefix(&self, prefix: &[u8]) -> Result<Vec<KeyValue>, Error> {
        let key: &[u8] = if prefix.is_empty() { &[0] } else { prefix };
        let m = self
            .call(
                "get_prefix",
                "/v3/kv/range",
                json!({ "key": b64::encode(key), "range_end": b64::encode(&prefix_end(prefix)) }),
            )
            .await?;
        decode_range(&m)
    }

    /// Writes `key = value`, attached to `lease` (0 = none); returns the
    /// store's revision after the write. An unknown lease is
    /// [`Error::Server`] ("etcdserver: requested lease not found").
    pub async fn put(&self, key: &[u8], value: &[u8], lease: LeaseId) -> Result<i64, Error> {
        let m = self
            .call("put", "/v3/kv/put", put_body(key, value, lease))
            .await?;
        decode_put(&m)
    }

    /// Deletes one key; returns how many keys went (0 or 1).
    pub async fn delete(&self, key: &[u8]) -> Result<u64, Error> {
        let m = self
            .call(
                "delete",
                "/v3/kv/deleterange",
                json!({ "key": b64::encode(key) }),
            )
            .await?;
        decode_delete(&m)
    }

    /// Runs a transaction.
    pub async fn txn(&self, txn: Txn) -> Result<TxnResponse, Error> {
        let body = json!({
            "compare": txn.compare.iter().map(Compare::json).collect::<Vec<_>>(),
            "success": txn.success.iter().map(Op::json).collect::<Vec<_>>(),
            "failure": txn.failure.iter().map(Op::json).collect::<Vec<_>>(),
        });
        let m = self.call("txn", "/v3/kv/txn", body).await?;
        decode_txn(&m)
    }

    /// Grants a lease of `ttl`, in whole seconds rounded up, at least 1.
    /// etcd may grant more (its minimum TTL); [`Lease::ttl`] is what it granted.
    pub async fn grant(&self, ttl: Duration) -> Result<Lease, Error> {
        let secs = ttl
            .as_secs()
            .saturating_add(u64::from(ttl.subsec_nanos() > 0))
            .clamp(1, i64::MAX as u64);
        let m = self
            .call(
                "grant",
                "/v3/lease/grant",
                json!({ "TTL": secs.to_string() }),
            )
            .await?;
        decode_grant(&m)
    }

    /// One keep-alive: Some(remaining ttl) or None if the lease no longer exists (expired/revoked: etcd answers TTL 0 or omits it).
    ///
    /// The remaining TTL is the lease's full TTL again (a keep-alive renews it).
    pub async fn keep_alive_once(&self, id: LeaseId) -> Result<Option<Duration>, Error> {
        let m = self
            .call(
                "keep_alive_once",
                "/v3/lease/keepalive",
                json!({ "ID": id.to_string() }),
            )
            .await?;
        decode_keep_alive(&m)
    }

    /// Revokes a lease, deleting every key attached to it at once. Revoking a
    /// lease that does not exist (never granted, expired, already revoked) is
    /// [`Error::Server`] with status 404 and etcd's message
    /// "etcdserver: requested lease not found".
    pub async fn revoke(&self, id: LeaseId) -> Result<(), Error> {
        self.call(
            "revoke",
            "/v3/lease/revoke",
            json!({ "ID": id.to_string() }),
        )
        .await?;
        Ok(())
    }
}

/// Decodes an answer's body: the first JSON value (streamed answers may carry
/// several, one per line), an object; etcd's errors become [`Error::Server`].
fn decode_answer(url: &str, path: &str, resp: http::Response) -> Result<Map<String, Value>, Error> {
    let mut values = serde_json::Deserializer::from_slice(&resp.body).into_iter::<Value>();
    let first = match values.next() {
        Some(Ok(v)) => Some(v),
        Some(Err(e)) => {
            if resp.status != 200 {
                return Err(Error::Server {
                    status: resp.status,
                    message: String::from_utf8_lossy(&resp.body).trim().to_string(),
                });
            }
            return Err(Error::Decode(format!(
                "{url} {path}: answer is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&resp.body[..resp.body.len().min(200)])
            )));
        }
        None => None,
    };
    let Some(Value::Object(m)) = first else {
        if resp.status != 200 {
            return Err(Error::Server {
                status: resp.status,
                message: format!("empty or non-object answer: {first:?}"),
            });
        }
        return Err(Error::Decode(format!(
            "{url} {path}: expected a JSON object, got {first:?}"
        )));
    };
    if let Some(e) = server_error(&m, resp.status) {
        return Err(e);
    }
    if resp.status != 200 {
        return Err(Error::Server {
            status: resp.status,
            message: Value::Object(m).to_string(),
        });
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"a"), b"b");
        assert_eq!(prefix_end(&[b'a', 0xff]), b"b");
        assert_eq!(prefix_end(&[0x01, 0xff, 0xff]), [0x02]);
        assert_eq!(prefix_end(&[0xff, 0xff]), [0]);
        assert_eq!(prefix_end(b""), [0]);
    }

    #[test]
    fn endpoints() {
        assert_eq!(
            parse_endpoint("http://127.0.0.1:2379").unwrap().addr,
            "127.0.0.1:2379"
        );
        assert_eq!(
            parse_endpoint("127.0.0.1:1234/").unwrap().addr,
            "127.0.0.1:1234"
        );
        assert_eq!(parse_endpoint("etcd").unwrap().addr, "etcd:2379");
        assert_eq!(parse_endpoint("[::1]:5").unwrap().addr, "[::1]:5");
        assert_eq!(parse_endpoint("[::1]").unwrap().addr, "[::1]:2379");
        assert!(parse_endpoint("https://x:1").is_err());
        assert!(parse_endpoint("http://").is_err());
    }

    #[test]
    fn errors_decode() {
        let r = |status, body: &str| http::Response {
            status,
            body: body.as_bytes().to_vec(),
        };
        match decode_answer(
            "u",
            "/p",
            r(
                404,
                r#"{"error":"etcdserver: requested lease not found","message":"etcdserver: requested lease not found","code":5}"#,
            ),
        ) {
            Err(Error::Server {
                status: 404,
                message,
            }) => {
                assert_eq!(message, "etcdserver: requested lease not found")
            }
            other => panic!("{other:?}"),
        }
        match decode_answer(
            "u",
            "/p",
            r(
                200,
                r#"{"error":{"grpc_code":5,"http_code":404,"message":"gone"}}"#,
            ),
        ) {
            Err(Error::Server {
                status: 404,
                message,
            }) => assert_eq!(message, "gone"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            decode_answer("u", "/p", r(200, "nope")),
            Err(Error::Decode(_))
        ));
        assert!(matches!(
            decode_answer("u", "/p", r(502, "bad gateway")),
            Err(Error::Server { status: 502, .. })
        ));
        let ok =
            decode_answer("u", "/p", r(200, "{\"result\":{\"TTL\":\"3\"}}\n{\"x\":1}")).unwrap();
        assert!(ok.contains_key("result"));
    }

    #[test]
    fn kv_decodes_with_omitted_fields() {
        let v: Value = serde_json::from_str(
            r#"{"key":"Zm9v","create_revision":"2","mod_revision":"3","version":"1"}"#,
        )
        .unwrap();
        let kv = decode_kv(&v, "kv").unwrap();
        assert_eq!(kv.key, b"foo");
        assert!(kv.value.is_empty());
        assert_eq!(
            (kv.create_revision, kv.mod_revision, kv.version, kv.lease),
            (2, 3, 1, 0)
        );
        let bad: Value = serde_json::from_str(r#"{"key":"Zm9v","version":"x"}"#).unwrap();
        assert!(matches!(decode_kv(&bad, "kv"), Err(Error::Decode(_))));
    }
}
