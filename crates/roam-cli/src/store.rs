//! `roam suspend`, `roam resume`, `roam store list|gc`: a suspended
//! environment's images (disk, memory, any file) kept as versions in a
//! `roam_store` chunk store, a local directory, an S3 bucket or a store
//! server reached through a roam session (`roam://HOST:PORT`, see
//! `store_remote`) — the user-facing first step of Internet Suspend/Resume.
//!
//! The versions of an environment are numbered from 1; a suspend writes the
//! next one, incrementally against the newest (its chunks are skipped
//! without asking the store). The user's store secret lives in
//! `<state dir>/store.secret` (32 bytes, mode 0600, made by the first
//! suspend). Every message names the store, environment and version it is
//! about; errors are one line each.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use roam_store::{
    chunk_count, BackendError, ChunkBackend, GcReport, LocalDir, Lookaside, LookasideRead,
    Manifest, ManifestError, RestoreStats, S3Config, Store, StoreError, SuspendStats, UserSecret,
    CHUNK_SIZE, S3,
};

use crate::cli::SuspendArgs;
use crate::cli::{CliError, CliResult, ResumeArgs, StoreAction, StoreArgs, StoreLocationArgs};
use crate::config::FileConfig;
use crate::demand::{DemandCounts, DemandImage, Fetch};
use crate::store_remote::RemoteBackend;
use crate::vm::{self, Incoming, Qmp, VM_DEVSTATE_IMAGE, VM_IMAGES, VM_MEMORY_IMAGE, VM_RAM_IMAGE};
use trickle::Trickle;

pub(crate) mod hoard;
pub(crate) mod leftovers;
pub(crate) mod trickle;

/// Any backend, so one `Store` type serves them all.
#[derive(Debug)]
pub(crate) enum AnyBackend {
    /// A directory.
    Local(LocalDir),
    /// A bucket of an S3-compatible service.
    S3(S3),
    /// A store server reached through a roam session (`roam://HOST:PORT`).
    /// (Boxed: its config and session slot outweigh the other variants.)
    Remote(Box<RemoteBackend>),
}

impl ChunkBackend for AnyBackend {
    async fn put_if_absent(&self, name: &str, bytes: Vec<u8>) -> Result<bool, BackendError> {
        match self {
            AnyBackend::Local(b) => b.put_if_absent(name, bytes).await,
            AnyBackend::S3(b) => b.put_if_absent(name, bytes).await,
            AnyBackend::Remote(b) => b.put_if_absent(name, bytes).await,
        }
    }

    async fn get(&self, name: &str, max_len: u64) -> Result<Vec<u8>, BackendError> {
        match self {
            AnyBackend::Local(b) => b.get(name, max_len).await,
            AnyBackend::S3(b) => b.get(name, max_len).await,
            AnyBackend::Remote(b) => b.get(name, max_len).await,
        }
    }

    async fn exists(&self, name: &str) -> Result<bool, BackendError> {
        match self {
            AnyBackend::Local(b) => b.exists(name).await,
            AnyBackend::S3(b) => b.exists(name).await,
            AnyBackend::Remote(b) => b.exists(name).await,
        }
    }

    async fn list(&self, prefix: &str) -> Result<Vec<String>, BackendError> {
        match self {
            AnyBackend::Local(b) => b.list(prefix).await,
            AnyBackend::S3(b) => b.list(prefix).await,
            AnyBackend::Remote(b) => b.list(prefix).await,
        }
    }

    async fn delete(&self, name: &str) -> Result<bool, BackendError> {
        match self {
            AnyBackend::Local(b) => b.delete(name).await,
            AnyBackend::S3(b) => b.delete(name).await,
            AnyBackend::Remote(b) => b.delete(name).await,
        }
    }
}

impl AnyBackend {
    /// Ends what the backend holds open for this command: a store server's
    /// session is closed (so the server frees it at once); nothing for the
    /// others.
    async fn close(&self) {
        if let AnyBackend::Remote(b) = self {
            b.close().await;
        }
    }
}

/// An opened store and what messages need to name.
struct Opened {
    /// The store (shared with the demand-fetch server's tasks).
    store: Arc<Store<AnyBackend>>,
    /// `/path/to/store` or `s3://bucket at https://endpoint`.
    desc: String,
    /// The secret's file.
    secret_path: PathBuf,
}

/// A usage or configuration problem (exit status 2) or a failure (1).
enum Fail {
    /// Bad arguments or configuration.
    Usage(String),
    /// Anything else.
    Run(CliError),
}

impl<E: Into<CliError>> From<E> for Fail {
    fn from(e: E) -> Self {
        Fail::Run(e.into())
    }
}

/// A [`Fail`] as the command's result: usage problems print and exit 2.
fn finish(r: Result<i32, Fail>) -> CliResult {
    match r {
        Ok(code) => Ok(code),
        Err(Fail::Usage(msg)) => {
            eprintln_whole!("roam: {msg}");
            Ok(2)
        }
        Err(Fail::Run(e)) => Err(e),
    }
}

/// Where the store is.
enum Location {
    /// A directory.
    Dir(PathBuf),
    /// `s3://BUCKET`.
    S3(S3Config),
    /// `roam://HOST:PORT`: a store server (`roam store serve`).
    Remote {
        /// `HOST:PORT`.
        addr: String,
        /// The bound on each operation.
        timeout: Duration,
    },
}

/// Finds the store from the flags, the config file and the environment.
fn locate(args: &StoreLocationArgs, config: &FileConfig) -> Result<Location, Fail> {
    let spec = args.store.clone().or_else(|| config.store.location.clone());
    let Some(spec) = spec else {
        return Ok(Location::Dir(crate::paths::state_dir(config).join("store")));
    };
    if let Some(addr) = spec.strip_prefix("roam://") {
        let addr = addr.trim_end_matches('/');
        let port_ok = addr
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !port_ok || addr.contains('/') {
            return Err(Fail::Usage(format!(
                "invalid store server {spec:?}: use roam://HOST:PORT (e.g. roam://store.example:7449)"
            )));
        }
        let timeout = match args.store_timeout.as_deref() {
            Some(t) => crate::config::parse_duration(t)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| {
                    Fail::Usage(format!(
                        "invalid --store-timeout {t:?}: a duration such as 30s or 5m"
                    ))
                })?,
            None => crate::store_remote::DEFAULT_TIMEOUT,
        };
        return Ok(Location::Remote {
            addr: addr.to_owned(),
            timeout,
        });
    }
    let Some(bucket) = spec.strip_prefix("s3://") else {
        return Ok(Location::Dir(PathBuf::from(spec)));
    };
    let bucket = bucket.trim_end_matches('/');
    if bucket.is_empty() || bucket.contains('/') {
        return Err(Fail::Usage(format!(
            "invalid S3 store {spec:?}: use s3://BUCKET (the whole bucket is the store)"
        )));
    }
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let endpoint = args
        .s3_endpoint
        .clone()
        .or_else(|| env("ROAM_S3_ENDPOINT"))
        .or_else(|| config.store.s3_endpoint.clone())
        .ok_or_else(|| {
            Fail::Usage(format!(
                "the S3 store {spec} needs an endpoint: --s3-endpoint URL or $ROAM_S3_ENDPOINT \
                 (e.g. https://s3.eu-west-1.amazonaws.com)"
            ))
        })?;
    let region = env("ROAM_S3_REGION")
        .or_else(|| config.store.s3_region.clone())
        .unwrap_or_else(|| "us-east-1".into());
    let (Some(access_key_id), Some(secret_access_key)) =
        (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY"))
    else {
        return Err(Fail::Usage(format!(
            "the S3 store {spec} needs credentials: set AWS_ACCESS_KEY_ID and \
             AWS_SECRET_ACCESS_KEY"
        )));
    };
    // Objects are encrypted and authenticated either way; plain http only
    // exposes the access pattern (and the signed requests) to the network.
    let allow_http = endpoint.starts_with("http://");
    Ok(Location::S3(S3Config {
        endpoint,
        bucket: bucket.to_owned(),
        region,
        access_key_id,
        secret_access_key,
        allow_http,
    }))
}

/// Opens the backend alone, for `roam store serve` (which never holds a
/// secret): a directory (made if missing) or an S3 bucket; a store server
/// is refused. `Err` is the command's result (the message was printed for
/// a usage problem).
pub(crate) fn open_backend(
    args: &StoreLocationArgs,
    config: &FileConfig,
) -> Result<(AnyBackend, String), CliResult> {
    match backend(args, config, true) {
        // Also when the config file's [store] names the server.
        Ok((AnyBackend::Remote(_), desc)) => Err(finish(Err(Fail::Usage(format!(
            "a store server keeps its objects in a directory or an S3 bucket, not another \
             store server ({desc}): --store DIR or s3://BUCKET"
        ))))),
        r => r.map_err(|f| finish(Err(f))),
    }
}

/// The backend of the store `args` name, and its description for messages;
/// `create`: a local directory may be made, else it must exist.
fn backend(
    args: &StoreLocationArgs,
    config: &FileConfig,
    create: bool,
) -> Result<(AnyBackend, String), Fail> {
    let location = locate(args, config)?;
    Ok(match location {
        Location::Dir(dir) => {
            let desc = dir.display().to_string();
            if !create && !dir.exists() {
                return Err(Fail::Run(CliError(format!(
                    "no store at {desc} (nothing was suspended there; --store names another)"
                ))));
            }
            if create && dir == crate::paths::state_dir(config).join("store") {
                if let Some(parent) = dir.parent() {
                    crate::paths::ensure_private_dir(parent).map_err(|e| {
                        CliError(format!(
                            "cannot create the state directory {}: {e}",
                            parent.display()
                        ))
                    })?;
                }
            }
            let local = LocalDir::open(&dir)
                .map_err(|e| CliError(format!("cannot open the store at {desc}: {e}")))?;
            (AnyBackend::Local(local), desc)
        }
        Location::S3(cfg) => {
            let desc = format!("s3://{} at {}", cfg.bucket, cfg.endpoint);
            let s3 = S3::new(&cfg).map_err(|e| Fail::Usage(format!("S3 store {desc}: {e}")))?;
            (AnyBackend::S3(s3), desc)
        }
        Location::Remote { addr, timeout } => {
            let desc = format!("roam://{addr}");
            (
                AnyBackend::Remote(Box::new(RemoteBackend::new(addr, timeout, config))),
                desc,
            )
        }
    })
}

/// Opens the store; `create`: a local directory may be made (suspend),
/// else it must exist. Loads (or, with `create`, makes) the secret.
fn open(args: &StoreLocationArgs, config: &FileConfig, create: bool) -> Result<Opened, Fail> {
    let (backend, desc) = backend(args, config, create)?;
    let secret_path = args
        .secret
        .clone()
        .or_else(|| config.store.secret.clone())
        .unwrap_or_else(|| crate::paths::state_dir(config).join("store.secret"));
    let secret = load_secret(&secret_path, create && args.secret.is_none())?;
    Ok(Opened {
        store: Arc::new(Store::new(backend, secret)),
        desc,
        secret_path,
    })
}

/// Reads the 32-byte secret at `path`; `create`: makes one if there is none.
fn load_secret(path: &Path, create: bool) -> Result<UserSecret, Fail> {
    let shown = path.display();
    match std::fs::read(path) {
        Ok(bytes) => {
            let bytes: [u8; 32] = bytes.as_slice().try_into().map_err(|_| {
                CliError(format!(
                    "the store secret {shown} is {} bytes, not 32: not a roam store secret",
                    bytes.len()
                ))
            })?;
            Ok(UserSecret::from_bytes(bytes))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
            let (secret, bytes) = UserSecret::generate()
                .map_err(|_| CliError("cannot draw random bytes for the store secret".into()))?;
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                crate::paths::ensure_private_dir(dir)
                    .map_err(|e| CliError(format!("cannot create {}: {e}", dir.display())))?;
            }
            crate::paths::write_atomic(path, &bytes, 0o600, false)
                .map_err(|e| CliError(format!("cannot write the store secret {shown}: {e}")))?;
            eprintln_whole!(
                "roam: created the store secret {shown} (mode 0600). It encrypts and names \
                 everything you store: keep a copy somewhere safe; losing it loses the data."
            );
            Ok(secret)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Fail::Run(CliError(format!(
            "no store secret at {shown}: the store's data can only be read with the secret it \
             was suspended with (copy that file here, or pass --secret FILE)"
        )))),
        Err(e) => Err(Fail::Run(CliError(format!(
            "cannot read the store secret {shown}: {e}"
        )))),
    }
}

/// Runs `work` (a command's part that uses `opened`), then ends the store's
/// connection whatever `work` returned, so a store server frees its session
/// at the end of the command, failures included.
async fn closing<T>(opened: &Opened, work: impl std::future::Future<Output = T>) -> T {
    let r = work.await;
    opened.store.backend().close().await;
    r
}

impl Opened {
    /// A store error worded for the user, naming the store and secret.
    fn explain(&self, e: StoreError) -> CliError {
        CliError(match e {
            StoreError::Manifest {
                env,
                version,
                source: ManifestError::WrongSecret,
            } => format!(
                "the store's manifest for {env} v{version} was not sealed with this secret \
                 ({}): use the secret {env} was suspended with (--secret FILE)",
                self.secret_path.display()
            ),
            StoreError::Manifest {
                env,
                version,
                source,
            } => format!(
                "the store's manifest for {env} v{version} in {} is refused: {source}",
                self.desc
            ),
            StoreError::ManifestMissing { env, version } => {
                format!(
                    "environment {env} has no version {version} in {}",
                    self.desc
                )
            }
            StoreError::ImageWrite { image, source } => {
                let full = matches!(
                    source.kind(),
                    std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
                );
                format!(
                    "writing image {image}: {source}{}",
                    if full {
                        " (the disk is full: free space or resume into another DIR)"
                    } else {
                        ""
                    }
                )
            }
            e @ (StoreError::ImageRead { .. } | StoreError::ImageTooLong { .. }) => e.to_string(),
            e => format!("store {}: {e}", self.desc),
        })
    }

    /// The versions of `env`, ascending; an error if it has none.
    async fn versions(&self, env: &str) -> Result<Vec<u64>, CliError> {
        let versions = self
            .store
            .versions(env)
            .await
            .map_err(|e| self.explain(e))?;
        if versions.is_empty() {
            return Err(CliError(format!(
                "no environment {env} in the store {} (`roam store list` shows what it holds)",
                self.desc
            )));
        }
        Ok(versions)
    }

    /// `asked` if `env` has it (an error naming the versions it has if
    /// not), else its newest version.
    async fn version(&self, env: &str, asked: Option<u64>) -> Result<u64, CliError> {
        let versions = self.versions(env).await?;
        match asked {
            Some(v) if !versions.contains(&v) => Err(CliError(format!(
                "environment {env} has no version {v} in {} (it has {})",
                self.desc,
                versions
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
            Some(v) => Ok(v),
            None => Ok(*versions.last().unwrap_or(&1)),
        }
    }

    /// Every manifest in the store as (environment, version), sorted.
    async fn all_versions(&self) -> Result<Vec<(String, u64)>, CliError> {
        let names = self
            .store
            .backend()
            .list("manifests/")
            .await
            .map_err(|e| self.explain(e.into()))?;
        let mut all: Vec<(String, u64)> = names
            .iter()
            .filter_map(|n| {
                let (env, version) = n.strip_prefix("manifests/")?.split_once('/')?;
                Some((env.to_owned(), version.parse().ok()?))
            })
            .collect();
        all.sort();
        Ok(all)
    }
}

/// `12.3 MB` (decimal megabytes, as transfer tools print them).
fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

/// `412 ms`, or `1.32 s` from a second on.
fn ms(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{} ms", d.as_millis())
    } else {
        format!("{:.2} s", d.as_secs_f64())
    }
}

/// Megabytes per second, for a summary.
fn rate(bytes: u64, d: Duration) -> String {
    format!("{:.1} MB/s", bytes as f64 / 1e6 / d.as_secs_f64().max(1e-6))
}

/// Progress on stderr: a bar redrawn in place on a terminal, phase lines
/// (at most one every [`PLAIN_EVERY`]) otherwise.
struct Reporter {
    /// When the command started.
    start: Instant,
    /// Whether stderr is a terminal.
    tty: bool,
    /// Whether a bar is on the current line.
    bar: bool,
    /// When the bar (or a plain progress line) was last written.
    drawn: Option<Instant>,
}

/// Interval between plain progress lines when stderr is not a terminal.
const PLAIN_EVERY: Duration = Duration::from_secs(5);

/// Interval between redraws of the bar (100 ms).
const BAR_EVERY: Duration = Duration::from_millis(100);

impl Reporter {
    /// A reporter starting now.
    fn new() -> Reporter {
        Reporter {
            start: Instant::now(),
            tty: std::io::stderr().is_terminal(),
            bar: false,
            drawn: None,
        }
    }

    /// `roam: [  0.12 s] MESSAGE`.
    fn phase(&mut self, msg: &str) {
        self.end_bar();
        eprintln_whole!(
            "roam: [{:>7.2} s] {msg}",
            self.start.elapsed().as_secs_f64()
        );
        if !self.tty {
            // The next plain progress line comes a while after this one.
            self.drawn = Some(Instant::now());
        }
    }

    /// `image`'s progress: `chunks` of `total_chunks` settled, `bytes` of
    /// `total_bytes` through.
    fn image(&mut self, image: &str, chunks: u64, total_chunks: u64, bytes: u64, total_bytes: u64) {
        let now = Instant::now();
        let every = if self.tty { BAR_EVERY } else { PLAIN_EVERY };
        if self.drawn.is_some_and(|t| now - t < every) {
            return;
        }
        self.drawn = Some(now);
        if !self.tty {
            self.phase(&format!(
                "{image}: {chunks}/{total_chunks} chunks, {} / {}",
                mb(bytes),
                mb(total_bytes)
            ));
            self.drawn = Some(now);
            return;
        }
        let frac = if total_chunks == 0 {
            1.0
        } else {
            (chunks as f64 / total_chunks as f64).min(1.0)
        };
        let width = 30;
        let filled = ((frac * width as f64) as usize).min(width);
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r      {image} {chunks}/{total_chunks} chunks, {} / {} [{}{}] {:>3.0}%",
            mb(bytes),
            mb(total_bytes),
            "#".repeat(filled),
            " ".repeat(width - filled),
            frac * 100.0
        );
        let _ = err.flush();
        self.bar = true;
    }

    /// Ends the bar's line, if one is drawn.
    fn end_bar(&mut self) {
        if self.bar {
            eprintln_whole!("");
            self.bar = false;
        }
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        self.end_bar();
    }
}

/// A suspend's view of its progress: which image, and the totals when it
/// began.
struct SuspendView {
    /// Progress output.
    rep: Reporter,
    /// Each image's name and length (from its metadata).
    images: Vec<(String, u64)>,
    /// The image being read.
    current: Option<usize>,
    /// The totals when it began.
    base: SuspendStats,
    /// The totals at the last report.
    last: SuspendStats,
}

impl SuspendView {
    /// Image `i` begins (the one before it is done).
    fn begin(&mut self, i: usize) {
        self.end_current();
        self.current = Some(i);
        self.base = self.last;
        let (name, len) = &self.images[i];
        let msg = format!("{name}: {} in {} chunks", mb(*len), chunk_count(*len));
        self.rep.phase(&msg);
    }

    /// The totals moved on.
    fn update(&mut self, stats: &SuspendStats) {
        self.last = *stats;
        if let Some(i) = self.current {
            let (name, len) = &self.images[i];
            let (name, len) = (name.clone(), *len);
            self.rep.image(
                &name,
                stats.chunks_done() - self.base.chunks_done(),
                chunk_count(len),
                stats.bytes_read - self.base.bytes_read,
                len,
            );
        }
    }

    /// Reports the image being read as done.
    fn end_current(&mut self) {
        if let Some(i) = self.current.take() {
            let (l, b) = (self.last, self.base);
            let msg = format!(
                "{}: done, {} chunks, {} read, {} uploaded ({} chunks)",
                self.images[i].0,
                l.chunks_total - b.chunks_total,
                mb(l.bytes_read - b.bytes_read),
                mb(l.bytes_uploaded - b.bytes_uploaded),
                l.chunks_uploaded - b.chunks_uploaded
            );
            self.rep.phase(&msg);
        }
    }
}

/// `roam suspend`.
pub(crate) async fn suspend(args: SuspendArgs, config: &FileConfig) -> CliResult {
    finish(suspend_inner(args, config).await)
}

/// `roam suspend`, with usage errors apart.
async fn suspend_inner(args: SuspendArgs, config: &FileConfig) -> Result<i32, Fail> {
    // Every file is opened and named before anything is written.
    let mut inputs: Vec<(PathBuf, String)> = Vec::new();
    for path in &args.files {
        let shown = path.display();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| {
                CliError(format!(
                    "{shown} has no usable file name (UTF-8) for its image"
                ))
            })?
            .to_owned();
        if !roam_store::valid_image_name(&name) {
            return Err(Fail::Usage(format!(
                "{shown}: {name:?} cannot name an image"
            )));
        }
        if args.vm.is_some() && VM_IMAGES.contains(&name.as_str()) {
            return Err(Fail::Usage(format!(
                "{shown}: with --vm, the image name {name} is the VM's memory: rename the file"
            )));
        }
        if let Some((first, _)) = inputs.iter().find(|(_, n)| *n == name) {
            return Err(Fail::Usage(format!(
                "{} and {shown} would both be image {name:?} (images are named by base name): \
                 rename or link one",
                first.display()
            )));
        }
        inputs.push((path.clone(), name));
    }
    // The store and secret are opened before a VM is stopped.
    let opened = open(&args.location, config, true)?;
    closing(&opened, suspend_opened(&args, &opened, inputs)).await
}

/// `roam suspend` once the inputs are checked and the store is open.
async fn suspend_opened(
    args: &SuspendArgs,
    opened: &Opened,
    mut inputs: Vec<(PathBuf, String)>,
) -> Result<i32, Fail> {
    let Some(qmp_path) = args.vm.clone() else {
        return suspend_images(args, opened, &inputs, None).await;
    };
    let mut rep = Reporter::new();
    let mut qmp = Qmp::connect(&qmp_path).await.map_err(|e| CliError(e.0))?;
    let memory = vm::memory_file_for(args.files.first().map(PathBuf::as_path));
    let _memory_guard = vm::RemoveOnDrop(memory.clone());
    // Lazy memory: guest RAM in a shared file is stored as a flat image
    // and the stream carries device state only (x-ignore-shared).
    let ram = qmp.shared_ram().await.map_err(|e| CliError(e.0))?;
    rep.phase(&format!(
        "stopping the VM ({}) and writing its {}",
        qmp_path.display(),
        if ram.is_some() {
            "device state (its RAM is a shared file)"
        } else {
            "memory image"
        }
    ));
    let saved = match qmp.stop_and_save(&memory, ram.is_some()).await {
        Ok(took) => took,
        Err(e) => return Err(continue_vm(&mut qmp, e.0).await),
    };
    let mem_len = std::fs::metadata(&memory).map(|m| m.len()).unwrap_or(0);
    match &ram {
        Some(ram) => {
            rep.phase(&format!(
                "device state: {} in {}; RAM: {}",
                mb(mem_len),
                ms(saved),
                ram.display()
            ));
            inputs.push((memory.clone(), VM_DEVSTATE_IMAGE.to_owned()));
            inputs.push((ram.clone(), VM_RAM_IMAGE.to_owned()));
        }
        None => {
            rep.phase(&format!("memory image: {} in {}", mb(mem_len), ms(saved)));
            inputs.push((memory.clone(), VM_MEMORY_IMAGE.to_owned()));
        }
    }
    drop(rep);
    match suspend_images(args, opened, &inputs, Some(saved)).await {
        Ok(code) => {
            // The environment is in the store: the VM here ends.
            if let Err(e) = qmp.execute("quit", serde_json::json!({})).await {
                eprintln_whole!(
                    "roam: the version is stored, but QEMU did not quit: {e} (stop it yourself)"
                );
            }
            Ok(code)
        }
        Err(Fail::Run(e)) => Err(continue_vm(&mut qmp, e.0).await),
        Err(usage) => {
            let _ = continue_vm(&mut qmp, String::new()).await;
            Err(usage)
        }
    }
}

/// After a failed VM suspend: lets the VM run on, and words the error so.
async fn continue_vm(qmp: &mut Qmp, error: String) -> Fail {
    match qmp.execute("cont", serde_json::json!({})).await {
        Ok(_) => Fail::Run(CliError(format!(
            "{error}; no version was written and the VM runs on here"
        ))),
        Err(e) => Fail::Run(CliError(format!(
            "{error}; no version was written, and the VM could not be continued ({e}): it is \
             stopped here"
        ))),
    }
}

/// Stores `inputs` (file, image name) as the next version of `args.env`.
/// `vm_saved`: how long QEMU took to write the memory image, for the summary.
async fn suspend_images(
    args: &SuspendArgs,
    opened: &Opened,
    inputs: &[(PathBuf, String)],
    vm_saved: Option<Duration>,
) -> Result<i32, Fail> {
    let mut files = Vec::new();
    let mut images: Vec<(String, u64)> = Vec::new();
    for (path, name) in inputs {
        let shown = path.display();
        let file =
            std::fs::File::open(path).map_err(|e| CliError(format!("cannot read {shown}: {e}")))?;
        let meta = file
            .metadata()
            .map_err(|e| CliError(format!("cannot read {shown}: {e}")))?;
        if meta.is_dir() {
            return Err(Fail::Run(CliError(format!(
                "{shown} is a directory: suspend takes files (images)"
            ))));
        }
        images.push((name.clone(), meta.len()));
        files.push(file);
    }
    let env = args.env.as_str();
    let versions = opened
        .store
        .versions(env)
        .await
        .map_err(|e| opened.explain(e))?;
    let previous = match versions.last() {
        Some(&v) => Some(
            opened
                .store
                .load_manifest(env, v)
                .await
                .map_err(|e| opened.explain(e))?,
        ),
        None => None,
    };
    let version = versions.last().map_or(1, |v| v + 1);
    let view = Mutex::new(SuspendView {
        rep: Reporter::new(),
        images: images.clone(),
        current: None,
        base: SuspendStats::default(),
        last: SuspendStats::default(),
    });
    let lock = || view.lock().unwrap_or_else(|p| p.into_inner());
    lock().rep.phase(&format!(
        "suspending {env} version {version} to {}{}",
        opened.desc,
        match versions.last() {
            Some(v) => format!(" (incremental against version {v})"),
            None => String::new(),
        }
    ));
    // Chunks a running `roam resume --trickle` of this environment wrote
    // back ahead (its live leases name them), for the summary only: the
    // suspend still asks the store for each chunk it does not know.
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let trickled: std::collections::HashSet<[u8; 32]> = match opened.store.leases(Some(env)).await {
        Ok(leases) => leases
            .into_iter()
            .filter(|l| l.is_live(now_ms))
            .flat_map(|l| l.chunks)
            .collect(),
        Err(e) => {
            lock().rep.end_bar();
            eprintln_whole!(
                "roam: warning: cannot read the trickle leases of {env}: {} (the summary \
                     will not count written-back chunks)",
                opened.explain(e).0
            );
            Default::default()
        }
    };
    let start = Instant::now();
    let readers = files
        .into_iter()
        .zip(images.iter().map(|(n, _)| n.clone()))
        .enumerate()
        .map(|(i, (file, name))| {
            lock().begin(i);
            (name, tokio::fs::File::from_std(file))
        });
    let result = opened
        .store
        .suspend_with_progress(env, version, readers, previous.as_ref(), &mut |_, stats| {
            lock().update(stats)
        })
        .await;
    let elapsed = start.elapsed();
    let (manifest, stats) = result.map_err(|e| {
        lock().rep.end_bar();
        opened.explain(e)
    })?;
    lock().end_current();
    drop(view);
    let stored = stats.chunks_unchanged + stats.chunks_present + stats.chunks_repeated;
    let mut out = format!("suspended {env} version {version} to {}\n", opened.desc);
    out += &format!("  images: {}\n", image_list(&manifest));
    out += &format!(
        "  chunks: {} total, {} uploaded, {stored} already stored ({} unchanged since the \
         previous version, {} found in the store, {} repeats)\n",
        stats.chunks_total,
        stats.chunks_uploaded,
        stats.chunks_unchanged,
        stats.chunks_present,
        stats.chunks_repeated
    );
    out += &format!(
        "  read {} ({} bytes), uploaded {} ({} bytes, after compression) in {}: {}\n",
        mb(stats.bytes_read),
        stats.bytes_read,
        mb(stats.bytes_uploaded),
        stats.bytes_uploaded,
        ms(elapsed),
        rate(stats.bytes_read, elapsed)
    );
    if !trickled.is_empty() {
        let before: std::collections::HashSet<[u8; 32]> = previous
            .iter()
            .flat_map(|m| m.chunks().map(|c| c.id))
            .collect();
        let new: std::collections::HashSet<[u8; 32]> = manifest
            .chunks()
            .map(|c| c.id)
            .filter(|id| !before.contains(id))
            .collect();
        let ahead = new.iter().filter(|id| trickled.contains(*id)).count();
        out += &format!(
            "  trickle: {ahead} of the {} chunks new in this version were written back while \
             the environment ran (roam resume --trickle); {} uploaded now\n",
            new.len(),
            stats.chunks_uploaded
        );
    }
    if let Some(saved) = vm_saved {
        out += &format!(
            "  VM: memory image written by QEMU in {}; the VM quits (resume it with `roam resume \
             --vm`)\n",
            ms(saved)
        );
    }
    print_out(&out);
    Ok(0)
}

/// `disk 8.4 MB, memory 1.0 MB`.
fn image_list(m: &Manifest) -> String {
    if m.images.is_empty() {
        return "none".into();
    }
    m.images
        .iter()
        .map(|i| format!("{} {} ({} bytes)", i.name, mb(i.len), i.len))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Writes to stdout, ignoring a closed pipe.
fn print_out(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
}

/// `roam resume`.
pub(crate) async fn resume(args: ResumeArgs, config: &FileConfig) -> CliResult {
    finish(resume_inner(args, config).await)
}

/// Whether an image name can be a file name in DIR (a manifest is
/// authenticated, but a name from it must still not leave DIR).
fn file_name_ok(name: &str) -> bool {
    !name.contains('/') && name != "." && name != ".."
}

/// `roam resume`, with usage errors apart.
async fn resume_inner(args: ResumeArgs, config: &FileConfig) -> Result<i32, Fail> {
    let opened = open(&args.location, config, false)?;
    closing(&opened, resume_opened(&args, &opened)).await
}

/// `roam resume` once the store is open.
async fn resume_opened(args: &ResumeArgs, opened: &Opened) -> Result<i32, Fail> {
    let env = args.env.as_str();
    let version = opened.version(env, args.version).await?;
    let manifest = opened
        .store
        .load_manifest(env, version)
        .await
        .map_err(|e| opened.explain(e))?;
    let has = |name: &str| manifest.images.iter().any(|i| i.name == name);
    // Lazy memory: the guest RAM is a flat image, the stream device state.
    let lazy = has(VM_RAM_IMAGE) && has(VM_DEVSTATE_IMAGE);
    if args.vm && !has(VM_MEMORY_IMAGE) && !lazy {
        return Err(Fail::Run(CliError(format!(
            "{env} version {version} holds no VM memory image ({VM_MEMORY_IMAGE}), nor lazy \
             memory ({VM_RAM_IMAGE} with {VM_DEVSTATE_IMAGE}): it was not suspended with --vm, \
             so there is no running VM to resume (drop --vm to write its images)"
        ))));
    }
    let dir = &args.dir;
    if let Some(held) = hoard::read_marker(dir) {
        return Err(Fail::Run(CliError(format!(
            "{} is a hoard{} ({} marks it), not a place to resume into: resume into another \
             directory and pass --lookaside {}",
            dir.display(),
            held.map_or_else(
                |_| String::new(),
                |h| format!(" of {} version {}", h.env, h.version)
            ),
            dir.join(hoard::MARKER).display(),
            dir.display()
        ))));
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| CliError(format!("cannot create {}: {e}", dir.display())))?;
    // What a killed resume left here (a FUSE mount, sockets, temporaries)
    // goes before this one writes anything.
    leftovers::sweep(dir, &mut |line: &str| eprintln_whole!("roam: {line}"));
    // Demand fetch: the images QEMU opens as `-drive file=DIR/<image>` are
    // served over NBD instead of copied in.
    let pid = std::process::id();
    let socket_for = |name: &str| dir.join(format!(".roam-nbd-{name}.{pid}.sock"));
    let (qemu, served) = if args.demand_fetch {
        let names: Vec<&str> = manifest
            .images
            .iter()
            .map(|i| i.name.as_str())
            .filter(|n| !VM_IMAGES.contains(n) && file_name_ok(n))
            .collect();
        let (qemu, served) = vm::nbd_drives(&args.qemu, dir, &names, socket_for);
        if served.is_empty() && !lazy {
            eprintln_whole!(
                "roam: warning: --demand-fetch: the QEMU command opens no image of the version \
                 as -drive file={}/<image>; every image is copied in first",
                dir.display()
            );
        }
        (qemu, served)
    } else {
        (args.qemu.clone(), Vec::new())
    };
    // Demand fetch of lazy memory: QEMU maps the RAM from a FUSE file in
    // a private mount point in DIR instead of DIR/vm-ram.
    let ram_mount =
        (args.vm && lazy && args.demand_fetch).then(|| dir.join(format!(".roam-ram.{pid}")));
    let qemu = if args.vm && lazy {
        let fuse_file = ram_mount.as_ref().map(|m| m.join(VM_RAM_IMAGE));
        vm::ram_backend(&qemu, dir, fuse_file.as_deref())
            .map_err(|e| CliError(format!("{env} version {version}: {e}")))?
    } else {
        qemu
    };
    for image in &manifest.images {
        if !file_name_ok(&image.name) {
            return Err(Fail::Run(CliError(format!(
                "{env} version {version} has an image named {:?}, which cannot be a file name",
                image.name
            ))));
        }
        let target = dir.join(&image.name);
        if !args.force && std::fs::symlink_metadata(&target).is_ok() {
            return Err(Fail::Run(CliError(format!(
                "{} exists: resume would overwrite it (remove it, choose another DIR, or pass \
                 --force)",
                target.display()
            ))));
        }
    }
    let mut rep = Reporter::new();
    // Installed before the first line: a Ctrl-C from here removes the
    // partial image instead of killing the process over it.
    let mut interrupt = std::pin::pin!(crate::signals::interrupt_or_terminate());
    rep.phase(&format!(
        "resuming {env} version {version} from {} into {}",
        opened.desc,
        dir.display()
    ));
    let start = Instant::now();
    let lookaside = if args.lookaside.is_empty() {
        None
    } else {
        Some(Arc::new(
            scan_lookaside(&args.lookaside, &manifest, &mut rep).await?,
        ))
    };
    let mut totals = RestoreStats::default();
    for image in &manifest.images {
        if served.contains(&image.name) || (ram_mount.is_some() && image.name == VM_RAM_IMAGE) {
            continue;
        }
        let target = dir.join(&image.name);
        let tmp = dir.join(format!(
            ".{}.roam-resume.{}",
            image.name,
            std::process::id()
        ));
        rep.phase(&format!(
            "{}: {} in {} chunks",
            image.name,
            mb(image.len),
            image.chunks.len()
        ));
        let chunks = image.chunks.len() as u64;
        let written = {
            let work = restore_one(
                opened,
                &manifest,
                &image.name,
                (&tmp, &target),
                lookaside.as_deref(),
                |done| rep.image(&image.name, done.chunks, chunks, done.bytes, image.len),
            );
            tokio::select! {
                r = work => r,
                sig = &mut interrupt => Err(CliError(format!(
                    "interrupted by signal {sig} while writing {}: nothing was left under its name",
                    image.name
                ))),
            }
        };
        let stats = match written {
            Ok(s) => s,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                rep.end_bar();
                return Err(e.into());
            }
        };
        totals.add(&stats);
        rep.phase(&format!(
            "{}: done, {} written{}",
            image.name,
            mb(stats.bytes),
            if lookaside.is_some() {
                format!(
                    " ({} of {} chunks from lookaside)",
                    stats.chunks_lookaside, stats.chunks
                )
            } else {
                String::new()
            }
        ));
    }
    let elapsed = start.elapsed();
    drop(rep);
    let total = totals.bytes;
    let mut out = format!(
        "resumed {env} version {version} from {} into {}\n  images: {}\n  wrote {} ({total} \
         bytes, every chunk verified) in {}: {}\n",
        opened.desc,
        dir.display(),
        image_list(&manifest),
        mb(total),
        ms(elapsed),
        rate(total, elapsed)
    );
    if lookaside.is_some() {
        out += &lookaside_summary(&totals);
    }
    if !served.is_empty() {
        out += &format!(
            "  served to QEMU on demand (NBD), not written yet: {}\n",
            served.join(", ")
        );
    }
    if ram_mount.is_some() {
        out += &format!("  served to QEMU on demand (FUSE): {VM_RAM_IMAGE}\n");
    }
    print_out(&out);
    if !args.vm {
        return Ok(0);
    }
    let memory = if lazy {
        (dir.join(VM_DEVSTATE_IMAGE), true)
    } else {
        (dir.join(VM_MEMORY_IMAGE), false)
    };
    if !served.is_empty() || ram_mount.is_some() {
        let trickle = match args.trickle.and_then(|r| r.0) {
            Some(rate) => Some(Arc::new(
                Trickle::new(opened.store.clone(), env, rate).map_err(CliError)?,
            )),
            None => None,
        };
        let demand = Demand {
            opened,
            manifest: Arc::new(manifest.clone()),
            lookaside,
            dir,
            what: format!("{env} version {version}"),
            started: start,
            trickle,
        };
        return demand
            .run(&qemu, &served, socket_for, (memory, ram_mount))
            .await;
    }
    let mut rep = Reporter::new();
    let code = vm::run_incoming(
        &qemu,
        dir,
        (&memory.0, memory.1),
        |msg| rep.phase(msg),
        |_| {},
    )
    .await
    .map_err(|e| CliError(format!("{env} version {version}: {e}")))?;
    Ok(code)
}

/// A `roam resume --vm --demand-fetch` past copy-in of the memory image.
struct Demand<'a> {
    /// The store.
    opened: &'a Opened,
    /// The version's manifest.
    manifest: Arc<Manifest>,
    /// `--lookaside`, consulted before the store.
    lookaside: Option<Arc<Lookaside>>,
    /// DIR.
    dir: &'a Path,
    /// `ENV version N`, for messages.
    what: String,
    /// When the resume began.
    started: Instant,
    /// `--trickle`: the write-back of the guest's disk writes, if on.
    trickle: Option<Arc<Trickle>>,
}

impl Demand<'_> {
    /// The verified chunks of `image`: from lookaside if a file there
    /// holds one whose SHA-256 matches now, else from the store (tag, then
    /// SHA-256 against the manifest), as copy-in takes them.
    fn fetch(&self, image: &str) -> Fetch {
        let store = self.opened.store.clone();
        let manifest = self.manifest.clone();
        let lookaside = self.lookaside.clone();
        let image = image.to_owned();
        let what = self.what.clone();
        Arc::new(move |index| {
            let (store, manifest, lookaside) = (store.clone(), manifest.clone(), lookaside.clone());
            let (image, what) = (image.clone(), what.clone());
            Box::pin(async move {
                if let Some(la) = &lookaside {
                    let entry = manifest.image(&image);
                    let chunk = entry.and_then(|e| e.chunks.get(index as usize));
                    let len = entry.and_then(|e| e.chunk_len(index));
                    if let (Some(chunk), Some(len)) = (chunk, len) {
                        if let LookasideRead::Found(bytes) = la.read_async(chunk, len).await {
                            return Ok((bytes, true));
                        }
                    }
                }
                store
                    .read_chunk(&manifest, &image, index)
                    .await
                    .map(|b| (b, false))
                    .map_err(|e| format!("{what}: {e}"))
            })
        })
    }

    /// Serves `served` over NBD and, with `ram_mount`, the guest RAM
    /// ([`VM_RAM_IMAGE`]) as a FUSE file mounted there; runs `qemu` loading
    /// `memory` (the file, and whether it is a lazy VM's device state),
    /// fills the images in the background once the guest runs (with lazy
    /// memory, only once its demand fetches have settled) and finishes the
    /// fill after QEMU exits; returns QEMU's exit status.
    async fn run(
        self,
        qemu: &[String],
        served: &[String],
        socket_for: impl Fn(&str) -> PathBuf,
        (memory, ram_mount): ((PathBuf, bool), Option<PathBuf>),
    ) -> Result<i32, Fail> {
        let pid = std::process::id();
        let report: Arc<dyn Fn(&str) + Send + Sync> =
            Arc::new(|line: &str| eprintln_whole!("roam: {line}"));
        let mut images = Vec::new();
        let mut servers = Vec::new();
        let mut guards = Vec::new();
        for name in served {
            let entry = self
                .manifest
                .image(name)
                .ok_or_else(|| CliError(format!("{}: no image {name}", self.what)))?;
            let target = self.dir.join(name);
            // A stale image of this name must not be taken for the new one
            // (by a suspend) while the new one fills; --force was checked.
            let _ = std::fs::remove_file(&target);
            let tmp = self.dir.join(format!(".{name}.roam-demand.{pid}"));
            let image = DemandImage::create(
                name,
                entry.len,
                CHUNK_SIZE as u64,
                (&tmp, &target),
                self.fetch(name),
                report.clone(),
            )
            .map_err(CliError)?;
            let image = Arc::new(image);
            let sock = socket_for(name);
            let _ = std::fs::remove_file(&sock);
            let listener = tokio::net::UnixListener::bind(&sock).map_err(|e| {
                CliError(format!(
                    "cannot listen on {} for QEMU's NBD client: {e} (a Unix socket path is at \
                     most 107 bytes: choose a shorter DIR)",
                    sock.display()
                ))
            })?;
            guards.push(vm::RemoveOnDrop(sock));
            servers.push(AbortOnDrop(tokio::spawn(crate::demand::serve(
                listener,
                image.clone(),
            ))));
            images.push(image);
        }
        // The disks alone: trickle write-back is for them.
        let disks = images.clone();
        let mut ram = None;
        if let Some(mountpoint) = ram_mount {
            let (image, mount) = self.mount_ram(&mountpoint, report.clone())?;
            images.push(image);
            ram = Some(mount);
        }
        let mut rep = Reporter::new();
        if !served.is_empty() {
            rep.phase(&format!(
                "serving {} over NBD from sockets in {} (demand fetch)",
                served.join(", "),
                self.dir.display()
            ));
        }
        if let Some(r) = &ram {
            rep.phase(&format!(
                "serving the guest RAM ({VM_RAM_IMAGE}) as a FUSE file in {} (demand fetch)",
                r.dir.display()
            ));
        }
        let settle = ram.is_some();
        // Trickle write-back runs from the start: a write of the guest at
        // any time is queued.
        let trickling = self.trickle.as_ref().map(|t| {
            rep.phase(&format!(
                "trickle write-back of the guest's disk writes to {} at up to {:.1} Mbit/s \
                 (lease leases/{}/{}.*)",
                self.opened.desc,
                t.rate as f64 * 8.0 / 1e6,
                t.env,
                t.run
            ));
            AbortOnDrop(tokio::spawn(t.clone().run(disks.clone(), report.clone())))
        });
        let mut at_start: Vec<DemandCounts> = Vec::new();
        let mut at_run: Vec<DemandCounts> = Vec::new();
        let mut qemu_started = None;
        let mut guest_ran = None;
        let mut fill = None;
        let begun = self.started;
        let result = vm::run_incoming(
            qemu,
            self.dir,
            (&memory.0, memory.1),
            |msg| rep.phase(msg),
            |at| match at {
                Incoming::Started => {
                    qemu_started = Some(begun.elapsed());
                    at_start = images.iter().map(|i| i.counts()).collect();
                }
                Incoming::Running => {
                    guest_ran = Some(begun.elapsed());
                    at_run = images.iter().map(|i| i.counts()).collect();
                    let images = images.clone();
                    fill = Some(AbortOnDrop(tokio::spawn(async move {
                        if settle {
                            faults_settled(&images, FILL_QUIET, FILL_WAIT_MAX).await;
                        }
                        let filled = fill_all(images).await;
                        if let Err(e) = &filled {
                            eprintln_whole!(
                                "roam: the background fill stopped: {e} (the guest runs on; a \
                                 chunk it reads is fetched then)"
                            );
                        }
                        filled
                    })));
                }
            },
        )
        .await;
        // QEMU has exited (a suspend stopped it, or it ended): what the
        // trickle wrote back is in the suspend's version or garbage now.
        let trickled = match (&self.trickle, trickling) {
            (Some(t), Some(task)) => Some(self.end_trickle(t, task, &disks).await),
            _ => None,
        };
        // QEMU has closed the RAM file (its dirty pages were written back
        // to the image then); the fill goes on without the mount.
        drop(ram);
        let code = match result {
            Ok(code) => code,
            Err(e) => {
                drop(fill);
                for i in &images {
                    let _ = std::fs::remove_file(i.tmp_path());
                }
                return Err(CliError(format!("{}: {e}", self.what)).into());
            }
        };
        // QEMU has exited: the rest of the fill, with progress.
        let mut fill = fill.unwrap_or_else(|| AbortOnDrop(tokio::spawn(fill_all(images.clone()))));
        let total_chunks: u64 = images.iter().map(|i| i.chunk_count()).sum();
        let total_bytes: u64 = served
            .iter()
            .filter_map(|n| self.manifest.image(n))
            .map(|e| e.len)
            .sum();
        let present = |images: &[Arc<DemandImage>]| -> u64 {
            images.iter().map(|i| i.counts().present).sum()
        };
        if present(&images) < total_chunks {
            rep.phase(&format!(
                "QEMU exited ({code}); fetching the {} chunks not yet present",
                total_chunks - present(&images)
            ));
        }
        let mut signal = std::pin::pin!(crate::signals::interrupt_or_terminate());
        let filled = loop {
            tokio::select! {
                sig = &mut signal => break Err(if sig == nix::sys::signal::Signal::SIGTERM as i32 {
                    "terminated (SIGTERM) during the background fill".into()
                } else {
                    "interrupted (Ctrl-C) during the background fill".into()
                }),
                r = &mut fill.0 => break r.unwrap_or_else(|e| Err(format!("the fill task failed: {e}"))),
                _ = tokio::time::sleep(Duration::from_millis(100)) => {
                    let p = present(&images);
                    rep.image("images", p, total_chunks, p.saturating_mul(CHUNK_SIZE as u64).min(total_bytes), total_bytes);
                }
            }
        };
        drop(servers);
        drop(guards);
        rep.end_bar();
        drop(rep);
        if let Err(e) = filled {
            return Err(CliError(format!(
                "the disk is incomplete: {e} (QEMU exited {code}; the fetched part is in {})",
                images
                    .iter()
                    .map(|i| i.tmp_path().display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
            .into());
        }
        let mut out = format!(
            "demand fetch of {}: QEMU started {} after the resume began, the guest ran after {}\n",
            self.what,
            qemu_started.map_or("-".into(), ms),
            guest_ran.map_or("-".into(), ms),
        );
        for (k, image) in images.iter().enumerate() {
            let end = image.counts();
            let s = at_start.get(k).copied().unwrap_or_default();
            let r = at_run.get(k).copied().unwrap_or_default();
            out += &format!(
                "  {}: {} of {} chunks present at QEMU start, {} when the guest ran; {} chunks ({}) \
                 fetched on demand before the guest ran, {} ({}) on demand in all, {} ({}) in the \
                 background; {} chunks written by the guest{}; {} complete\n",
                image.name(),
                s.present,
                image.chunk_count(),
                r.present,
                r.demand_chunks,
                mb(r.demand_bytes),
                end.demand_chunks,
                mb(end.demand_bytes),
                end.background_chunks,
                mb(end.background_bytes),
                end.dirty,
                if self.lookaside.is_some() {
                    format!(", {} from lookaside", end.lookaside_chunks)
                } else {
                    String::new()
                },
                self.dir.join(image.name()).display()
            );
        }
        if let Some(line) = trickled {
            out += &line;
        }
        print_out(&out);
        Ok(code)
    }

    /// The guest RAM's [`DemandImage`] (its cache file DIR/.vm-ram.roam-demand.PID,
    /// renamed DIR/vm-ram once complete), mounted as the one file of a FUSE
    /// file system on `mountpoint` (made here); the mount is undone and the
    /// directory removed when the returned guard drops.
    fn mount_ram(
        &self,
        mountpoint: &Path,
        report: Arc<dyn Fn(&str) + Send + Sync>,
    ) -> Result<(Arc<DemandImage>, RamMount), Fail> {
        let pid = std::process::id();
        let entry = self
            .manifest
            .image(VM_RAM_IMAGE)
            .ok_or_else(|| CliError(format!("{}: no image {VM_RAM_IMAGE}", self.what)))?;
        let target = self.dir.join(VM_RAM_IMAGE);
        let _ = std::fs::remove_file(&target);
        let tmp = self.dir.join(format!(".{VM_RAM_IMAGE}.roam-demand.{pid}"));
        let image = Arc::new(
            DemandImage::create(
                VM_RAM_IMAGE,
                entry.len,
                CHUNK_SIZE as u64,
                (&tmp, &target),
                self.fetch(VM_RAM_IMAGE),
                report,
            )
            .map_err(CliError)?,
        );
        std::fs::create_dir_all(mountpoint)
            .map_err(|e| CliError(format!("cannot create {}: {e}", mountpoint.display())))?;
        let mut guard = RamMount {
            mount: None,
            dir: mountpoint.to_owned(),
        };
        guard.mount = Some(
            crate::demand::fuse::mount(
                image.clone(),
                mountpoint,
                tokio::runtime::Handle::current(),
            )
            .map_err(CliError)?,
        );
        Ok((image, guard))
    }

    /// Stops the trickle (at a safe point: within one upload), releases
    /// its leases, and returns the summary's trickle line.
    async fn end_trickle(
        &self,
        t: &Arc<Trickle>,
        mut task: AbortOnDrop<()>,
        images: &[Arc<DemandImage>],
    ) -> String {
        t.stop();
        if tokio::time::timeout(Duration::from_secs(30), &mut task.0)
            .await
            .is_err()
        {
            eprintln_whole!("roam: trickle: an upload still ran after 30 s; abandoned");
        }
        drop(task);
        let released = match trickle::release(&t.store, &t.env, &t.run).await {
            Ok(n) => format!(
                "its lease released ({n} lease object{} deleted)",
                if n == 1 { "" } else { "s" }
            ),
            Err(e) => format!("its lease not released ({e}; `roam store gc` drops it once stale)"),
        };
        format!(
            "  trickle: {} when QEMU exited; {released}\n",
            t.summary(images.iter().map(|i| i.unsent()).sum())
        )
    }
}

/// How long the guest must have caused no demand fetch before the
/// background fill of a lazy-memory resume starts (1.5 s: longer than the
/// test guest's 1 s tick, so the fill does not compete with the faults of
/// its first interaction; scripts/isr-lazy-memory/README.md measured a fill
/// from the start costing 0.5-1 s of first tick at 100 Mbit/s).
const FILL_QUIET: Duration = Duration::from_millis(1500);

/// Longest the fill waits for [`FILL_QUIET`] (15 s): a guest that keeps
/// faulting is filled anyway.
const FILL_WAIT_MAX: Duration = Duration::from_secs(15);

/// Returns once `images` have fetched nothing on demand for `quiet`, or
/// after `max` (polled every 50 ms).
async fn faults_settled(images: &[Arc<DemandImage>], quiet: Duration, max: Duration) {
    let start = Instant::now();
    let demand = || -> u64 { images.iter().map(|i| i.counts().demand_chunks).sum() };
    let (mut last, mut since) = (demand(), Instant::now());
    while start.elapsed() < max {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = demand();
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() >= quiet {
            return;
        }
    }
}

/// The FUSE mount of a lazy-memory resume's guest RAM: unmounted (the
/// session's thread joined) and its mount point removed when dropped, on every exit path of `roam resume`
/// (SIGINT and SIGTERM reach QEMU, whose exit ends the resume normally).
struct RamMount {
    /// The session; `None` only while mounting.
    mount: Option<crate::demand::fuse::MemoryMount>,
    /// The mount point, a directory roam made in DIR.
    dir: PathBuf,
}

impl Drop for RamMount {
    fn drop(&mut self) {
        if let Some(mount) = self.mount.take() {
            // Unmounting joins the FUSE thread, which may wait for this
            // runtime (a fetch in flight): let the other workers run it.
            let multi = tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
            if multi {
                tokio::task::block_in_place(|| drop(mount));
            } else {
                drop(mount);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Aborts a task when dropped (the NBD servers, an unfinished fill).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Fetches the chunks of `images` not yet present, in order, and renames
/// each complete image to its name.
async fn fill_all(images: Vec<Arc<DemandImage>>) -> Result<(), String> {
    for image in images {
        let started = Instant::now();
        image.fill().await?;
        let path = image.finish()?;
        let c = image.counts();
        eprintln_whole!(
            "roam: {}: background fill done in {}: {} chunks on demand, {} in the background; \
             {} is complete",
            image.name(),
            ms(started.elapsed()),
            c.demand_chunks,
            c.background_chunks,
            path.display()
        );
    }
    Ok(())
}

/// The summary's lookaside line: `  lookaside: 70 of 72 chunks (9.2 MB)
/// taken locally, 0.3 MB fetched: ...` with the exact counts after the
/// colon, and a note of the chunks found but refused.
fn lookaside_summary(t: &RestoreStats) -> String {
    let mut line = format!(
        "  lookaside: {} of {} chunks ({}) taken locally, {} fetched: {} bytes local, {} chunks \
         and {} bytes fetched, {} bytes of objects from the store\n",
        t.chunks_lookaside,
        t.chunks,
        mb(t.bytes_lookaside),
        mb(t.bytes_fetched),
        t.bytes_lookaside,
        t.chunks_fetched,
        t.bytes_fetched,
        t.object_bytes_fetched
    );
    if t.chunks_rejected > 0 {
        line += &format!(
            "  lookaside: {} chunks found there no longer matched the manifest (changed since \
             indexed) and were fetched instead\n",
            t.chunks_rejected
        );
    }
    line
}

/// Indexes the `--lookaside` paths for `manifest`'s chunks (off the async
/// threads: it reads the files), warning about paths that cannot be used.
async fn scan_lookaside(
    paths: &[PathBuf],
    manifest: &Manifest,
    rep: &mut Reporter,
) -> Result<Lookaside, Fail> {
    // Hoards of this very version: their images are the version's, taken
    // at their places instead of read ahead (each chunk still checked).
    let mut laid_out = Vec::new();
    let mut scanned = Vec::new();
    for path in paths {
        // A store directory's objects are sealed: none hashes to a chunk.
        if path.join("objects").is_dir() && path.join("tmp").is_dir() {
            eprintln_whole!(
                "roam: warning: lookaside {} looks like a roam store: its chunks are encrypted \
                 and cannot be found by hash (use it as --store, or name resumed files)",
                path.display()
            );
        }
        let marker = hoard::read_marker(path);
        match &marker {
            Some(Ok(h)) if h.env != manifest.env => eprintln_whole!(
                "roam: warning: lookaside {} is a hoard of environment {}, not {}: few of its \
                 chunks will match (hoard {} with `roam hoard --env {}`)",
                path.display(),
                h.env,
                manifest.env,
                manifest.env,
                manifest.env
            ),
            Some(Ok(h)) => rep.phase(&format!(
                "lookaside {} is a hoard of {} version {}{}",
                path.display(),
                h.env,
                h.version,
                match h.version.cmp(&manifest.version) {
                    std::cmp::Ordering::Equal => " (this version)",
                    std::cmp::Ordering::Less => " (older: its unchanged chunks serve)",
                    std::cmp::Ordering::Greater => " (newer: its unchanged chunks serve)",
                }
            )),
            _ => {}
        }
        match marker {
            Some(Ok(h)) if h.env == manifest.env && h.version == manifest.version => {
                laid_out.push(path.join(hoard::IMAGES));
            }
            _ => scanned.push(path.clone()),
        }
    }
    let started = Instant::now();
    let m = manifest.clone();
    let la =
        tokio::task::spawn_blocking(move || Lookaside::laid_out_then_scan(&laid_out, &scanned, &m))
            .await
            .map_err(|e| CliError(format!("indexing the lookaside paths failed: {e}")))?;
    let scan = la.scan_report();
    for (path, e) in &scan.unusable {
        rep.end_bar();
        eprintln_whole!(
            "roam: warning: lookaside {}: {e} (not used; its chunks come from the store)",
            path.display()
        );
    }
    let distinct = manifest
        .images
        .iter()
        .flat_map(|i| i.chunks.iter().map(|c| c.hash))
        .collect::<std::collections::HashSet<_>>()
        .len();
    rep.phase(&format!(
        "lookaside: indexed {} files ({} read{}{}) in {}: {} of the version's {distinct} \
         distinct chunks found",
        scan.files,
        mb(scan.bytes_scanned),
        if scan.by_place > 0 {
            format!(
                "; {} chunks at their places in a hoard of this version, read when used",
                scan.by_place
            )
        } else {
            String::new()
        },
        if scan.skipped > 0 {
            format!(", {} unreadable entries skipped", scan.skipped)
        } else {
            String::new()
        },
        ms(started.elapsed()),
        scan.chunks_found
    ));
    Ok(la)
}

/// Writes image `name` to `tmp` (mode 0600), syncs it and renames it to
/// `target` (`paths` is `(tmp, target)`), taking chunks from `lookaside`
/// where it holds them; returns where the chunks came from. The disk
/// writes the image while it is still being written ([`EarlyWriteback`]),
/// so the closing sync has little left to wait for.
async fn restore_one(
    opened: &Opened,
    manifest: &Manifest,
    name: &str,
    (tmp, target): (&Path, &Path),
    lookaside: Option<&Lookaside>,
    mut progress: impl FnMut(&RestoreStats) + Send,
) -> Result<RestoreStats, CliError> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(tmp)
        .map_err(|e| CliError(format!("cannot create {}: {e}", tmp.display())))?;
    let mut early = EarlyWriteback::new(&file);
    let mut file = tokio::fs::File::from_std(file);
    let written = opened
        .store
        .restore_image_from(manifest, name, &mut file, lookaside, &mut |stats| {
            early.wrote(stats.bytes);
            progress(stats)
        })
        .await
        .map_err(|e| opened.explain(e))?;
    file.sync_all().await.map_err(|e| {
        opened.explain(StoreError::ImageWrite {
            image: name.to_owned(),
            source: e,
        })
    })?;
    drop(file);
    tokio::fs::rename(tmp, target).await.map_err(|e| {
        CliError(format!(
            "cannot rename {} to {}: {e}",
            tmp.display(),
            target.display()
        ))
    })?;
    Ok(written)
}

/// Starts the disk writing an image while it is still being written: each
/// time another [`EarlyWriteback::EVERY`] bytes have been handed to the
/// file, a blocking thread syncs what it holds so far (`fdatasync` of a
/// second descriptor; one at a time, skipped while one runs). The writes go
/// on meanwhile, so the device works while chunks are read and verified,
/// and the sync before the rename waits only for the tail: a fresh 146 MB
/// resume from lookaside spent a third of its time in its two closing
/// syncs. A failed early sync is left to the closing one to report.
struct EarlyWriteback {
    /// The second descriptor, if it could be made (if not: no early syncs).
    file: Option<Arc<std::fs::File>>,
    /// Whether a sync runs now.
    busy: Arc<std::sync::atomic::AtomicBool>,
    /// Bytes written when the next sync is due.
    next: u64,
}

impl EarlyWriteback {
    /// Bytes between two early syncs (4 MiB: 1 and 16 MiB were slower).
    const EVERY: u64 = 4 << 20;

    /// For `file`, just created.
    fn new(file: &std::fs::File) -> EarlyWriteback {
        EarlyWriteback {
            file: file.try_clone().ok().map(Arc::new),
            busy: Arc::default(),
            next: Self::EVERY,
        }
    }

    /// `bytes` have been written so far: syncs them if one is due and none
    /// runs (must be called on a tokio runtime).
    fn wrote(&mut self, bytes: u64) {
        use std::sync::atomic::Ordering;
        let Some(file) = &self.file else { return };
        if bytes < self.next || self.busy.swap(true, Ordering::AcqRel) {
            return;
        }
        self.next = bytes + Self::EVERY;
        let (file, busy) = (file.clone(), self.busy.clone());
        tokio::task::spawn_blocking(move || {
            let _ = file.sync_data();
            busy.store(false, Ordering::Release);
        });
    }
}

/// `roam store ...`.
pub(crate) async fn run(args: StoreArgs, config: &FileConfig) -> CliResult {
    finish(match args.action {
        StoreAction::List { env, location } => list(env, location, config).await,
        StoreAction::Serve(a) => return crate::store_remote::serve(a, config).await,
        StoreAction::Gc {
            env,
            keep,
            location,
        } => gc(env, keep, location, config).await,
    })
}

/// `roam store list`.
async fn list(
    env: Option<String>,
    location: StoreLocationArgs,
    config: &FileConfig,
) -> Result<i32, Fail> {
    let opened = open(&location, config, false)?;
    closing(&opened, list_opened(env, &opened)).await
}

/// `roam store list` once the store is open.
async fn list_opened(env: Option<String>, opened: &Opened) -> Result<i32, Fail> {
    let all: Vec<(String, u64)> = match &env {
        Some(env) => opened
            .versions(env)
            .await?
            .into_iter()
            .map(|v| (env.clone(), v))
            .collect(),
        None => opened.all_versions().await?,
    };
    let mut out = format!("store {}\n", opened.desc);
    if all.is_empty() {
        out += "  (no environments)\n";
    }
    let mut last_env: Option<&str> = None;
    for (env, version) in &all {
        if last_env != Some(env.as_str()) {
            out += &format!("{env}\n");
            last_env = Some(env);
        }
        let m = opened
            .store
            .load_manifest(env, *version)
            .await
            .map_err(|e| opened.explain(e))?;
        let size: u64 = m.images.iter().map(|i| i.len).sum();
        out += &format!(
            "  version {version}: {} in {} chunks: {}\n",
            mb(size),
            m.images.iter().map(|i| i.chunks.len()).sum::<usize>(),
            image_list(&m)
        );
    }
    print_out(&out);
    Ok(0)
}

/// `roam store gc`.
async fn gc(
    env: String,
    keep: u64,
    location: StoreLocationArgs,
    config: &FileConfig,
) -> Result<i32, Fail> {
    let opened = open(&location, config, false)?;
    closing(&opened, gc_opened(env, keep, &opened)).await
}

/// `roam store gc` once the store is open.
async fn gc_opened(env: String, keep: u64, opened: &Opened) -> Result<i32, Fail> {
    let versions = opened.versions(&env).await?;
    let cut = versions
        .len()
        .saturating_sub(usize::try_from(keep).unwrap_or(usize::MAX));
    let doomed = &versions[..cut];
    // Every remaining manifest is opened before anything is deleted: one
    // this secret cannot open would have its chunks deleted.
    let mut kept = Vec::new();
    for (e, v) in opened.all_versions().await? {
        if e == env && doomed.contains(&v) {
            continue;
        }
        let m = opened.store.load_manifest(&e, v).await.map_err(|err| {
            CliError(format!(
                "{}; nothing was deleted (gc must know every version's chunks)",
                opened.explain(err).0
            ))
        })?;
        kept.push(m);
    }
    let mut out = String::new();
    for &v in doomed {
        opened
            .store
            .delete_manifest(&env, v)
            .await
            .map_err(|e| opened.explain(e))?;
        out += &format!("deleted {env} version {v} (its manifest)\n");
    }
    let GcReport {
        chunks_examined,
        chunks_kept,
        chunks_leased,
        leases_live,
        leases_expired,
        deleted,
    } = opened
        .store
        .gc(&kept, std::time::SystemTime::now())
        .await
        .map_err(|e| {
            let lease = matches!(e, StoreError::Lease { .. });
            let msg = opened.explain(e).0;
            CliError(if lease {
                format!(
                    "{msg}; nothing was deleted (gc must know the chunks of every running \
                     environment)"
                )
            } else {
                msg
            })
        })?;
    out += &format!(
        "deleted {} chunks no remaining version uses; kept {chunks_kept} of {chunks_examined} \
         for {} versions ({} of {env})",
        deleted.len(),
        kept.len(),
        kept.iter().filter(|m| m.env == env).count()
    );
    if leases_live > 0 {
        out += &format!(
            " and {leases_live} running environments ({chunks_leased} chunks written back by \
             `roam resume --trickle`, in no version yet)"
        );
    }
    out += "\n";
    if !leases_expired.is_empty() {
        out += &format!(
            "deleted {} stale trickle leases (their runs ended without releasing them)\n",
            leases_expired.len()
        );
    }
    print_out(&out);
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_names_stay_in_dir() {
        assert!(file_name_ok("disk.img"));
        for bad in ["a/b", "..", ".", "../x"] {
            assert!(!file_name_ok(bad), "{bad}");
        }
    }
}
