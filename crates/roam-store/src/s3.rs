//! [`S3`]: objects in a bucket of any S3-compatible service (AWS, MinIO,
//! Ceph, s3s-fs), through Apache Arrow's `object_store` client.
//!
//! Object names map to keys unchanged (`chunks/<id>`,
//! `manifests/<env>/<version>`). S3 writes are atomic by the protocol (an
//! object appears whole when its PUT completes). A failed request is retried
//! 3 times (about a second), so an unreachable endpoint is an error soon,
//! not a wait of minutes.

use futures_util::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, RetryConfig};

use crate::backend::{check_name, check_prefix, BackendError, ChunkBackend};

/// Retries of a failed request (object_store's default, 10 over up to 3
/// minutes, makes an unreachable endpoint look like a hang; 3 take about a
/// second with the default backoff of 100 ms doubling).
const MAX_RETRIES: usize = 3;

/// No retry starts later than this after the first attempt.
const RETRY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How long a TCP connect to the endpoint may take.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Where the bucket is and how to sign requests.
#[derive(Clone)]
pub struct S3Config {
    /// The service's URL, e.g. `https://s3.eu-west-1.amazonaws.com` or
    /// `http://127.0.0.1:9000`. Path-style requests are used.
    pub endpoint: String,
    /// The bucket (it must exist).
    pub bucket: String,
    /// The region requests are signed for (`us-east-1` for most
    /// non-AWS services).
    pub region: String,
    /// The access key id.
    pub access_key_id: String,
    /// The secret access key.
    pub secret_access_key: String,
    /// Whether a plain `http://` endpoint is allowed (tests, a trusted
    /// LAN); objects are encrypted either way, but requests are signed
    /// only, not private.
    pub allow_http: bool,
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"..")
            .field("allow_http", &self.allow_http)
            .finish()
    }
}

/// A bucket of an S3-compatible service (module docs).
#[derive(Debug)]
pub struct S3 {
    /// The client; it holds the connection pool.
    store: AmazonS3,
}

impl S3 {
    /// A client for `config`'s bucket. Nothing is sent until the first call.
    pub fn new(config: &S3Config) -> Result<Self, BackendError> {
        let store = AmazonS3Builder::new()
            .with_endpoint(&config.endpoint)
            .with_bucket_name(&config.bucket)
            .with_region(&config.region)
            .with_access_key_id(&config.access_key_id)
            .with_secret_access_key(&config.secret_access_key)
            .with_virtual_hosted_style_request(false)
            .with_retry(RetryConfig {
                max_retries: MAX_RETRIES,
                retry_timeout: RETRY_TIMEOUT,
                ..RetryConfig::default()
            })
            .with_client_options(
                ClientOptions::new()
                    .with_connect_timeout(CONNECT_TIMEOUT)
                    .with_allow_http(config.allow_http),
            )
            .build()
            .map_err(|e| BackendError::Config(e.to_string()))?;
        Ok(S3 { store })
    }
}

/// An `object_store` error as ours.
fn remote(op: &'static str, name: &str, e: object_store::Error) -> BackendError {
    match e {
        object_store::Error::NotFound { .. } => BackendError::NotFound {
            name: name.to_owned(),
        },
        e => BackendError::Remote {
            op,
            name: name.to_owned(),
            message: e.to_string(),
        },
    }
}

impl ChunkBackend for S3 {
    async fn put_if_absent(&self, name: &str, bytes: Vec<u8>) -> Result<bool, BackendError> {
        // Check, then put. Two writers racing on one chunk name write the
        // same bytes (convergent encryption), so the race is harmless for
        // chunks; for a manifest it needs two suspends of one version at
        // once, which the caller must not do.
        if self.exists(name).await? {
            return Ok(false);
        }
        self.store
            .put(&Path::from(name), bytes.into())
            .await
            .map_err(|e| remote("put", name, e))?;
        Ok(true)
    }

    async fn get(&self, name: &str, max_len: u64) -> Result<Vec<u8>, BackendError> {
        check_name(name)?;
        let got = self
            .store
            .get(&Path::from(name))
            .await
            .map_err(|e| remote("get", name, e))?;
        let too_large = |len| BackendError::TooLarge {
            name: name.to_owned(),
            len,
            max: max_len,
        };
        if got.meta.size > max_len {
            return Err(too_large(got.meta.size));
        }
        // Collected piece by piece against the limit: the body may be
        // longer than the length the server announced.
        let mut body = got.into_stream();
        let mut bytes = Vec::new();
        while let Some(piece) = body.next().await {
            let piece = piece.map_err(|e| remote("get", name, e))?;
            let len = bytes.len() as u64 + piece.len() as u64;
            if len > max_len {
                return Err(too_large(len));
            }
            bytes.extend_from_slice(&piece);
        }
        Ok(bytes)
    }

    async fn exists(&self, name: &str) -> Result<bool, BackendError> {
        check_name(name)?;
        match self.store.head(&Path::from(name)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(remote("head", name, e)),
        }
    }

    async fn list(&self, prefix: &str) -> Result<Vec<String>, BackendError> {
        check_prefix(prefix)?;
        let dir = prefix.strip_suffix('/').map(Path::from);
        let mut stream = self.store.list(dir.as_ref());
        let mut names = Vec::new();
        while let Some(meta) = stream.next().await {
            let meta = meta.map_err(|e| remote("list", prefix, e))?;
            let name = meta.location.to_string();
            // Keys this store did not write are ignored.
            if check_name(&name).is_ok() && name.starts_with(prefix) {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    async fn delete(&self, name: &str) -> Result<bool, BackendError> {
        if !self.exists(name).await? {
            return Ok(false);
        }
        self.store
            .delete(&Path::from(name))
            .await
            .map_err(|e| remote("delete", name, e))?;
        Ok(true)
    }
}
