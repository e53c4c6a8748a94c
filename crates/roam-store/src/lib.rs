//! roam-store: a content-addressed, encrypted chunk store for suspended
//! environments — the storage half of Internet Suspend/Resume (Kozuch &
//! Satyanarayanan; `../shared/papers/internet-suspend-resume.txt`).
//!
//! An environment (a VM's disk and memory, a process tree's images) is a set
//! of named *images*. [`Store::suspend`] cuts each into 128 KiB chunks
//! ([`CHUNK_SIZE`]), seals each with *convergent encryption* (key and object
//! name derived from the chunk's SHA-256 and the user's secret), uploads the
//! chunks the backend lacks, and writes a sealed [`Manifest`] (ISR's
//! *keyring*) listing every chunk's hash and id. [`Store::read_chunk`] fetches
//! one chunk on demand and [`Store::restore_image`] a whole image; every
//! chunk is verified (AEAD tag, then SHA-256 against the manifest) before a
//! byte of it is returned. [`Store::gc`] deletes chunks no kept manifest
//! references.
//!
//! Properties:
//! - one user's identical chunks are stored once (within an image, across
//!   images, across versions); an incremental suspend given the previous
//!   manifest uploads only changed chunks, with no request for the others;
//! - nothing links two users' chunks (ids and keys are keyed by the secret);
//! - the backend sees object names, sizes and access patterns, never data
//!   or which chunks form which image;
//! - a tampered, swapped or truncated object is an error naming the image,
//!   chunk index and object id, never wrong data; a manifest sealed with
//!   another secret, altered, or copied to another environment or version
//!   is refused with a precise [`ManifestError`].
//!
//! [`Store::suspend_with_progress`] and [`Store::restore_image_with_progress`]
//! report each chunk as it is settled or written (the `roam suspend` and
//! `roam resume` commands draw their progress from them).
//!
//! The storage seam is [`ChunkBackend`], with two implementations:
//! [`LocalDir`] (a directory, atomic writes) and `S3` (any S3-compatible
//! service through `object_store`; cargo feature `s3`, on by default).
//!
//! The object layout, chunk format, manifest wire format and the crypto
//! construction are specified byte by byte in `docs/STORE.md`.
//!
//! Lookaside ([`Lookaside`], ISR's lookaside cache): a restore given local
//! or portable files (an older resumed copy, a copy on removable media)
//! takes every chunk found there by its SHA-256 instead of fetching it, and
//! uses a chunk from there only if its bytes hash to the manifest's entry
//! when read; [`Store::restore_image_from`] reports hits and the bytes the
//! backend sent ([`RestoreStats`]).
//!
//! Non-goals (for now): demand paging into a running VM is a layer above
//! this one; there is no locking between concurrent writers of one user (a
//! garbage collection must not run during a suspend); the manifest hides
//! image contents and chunk ordering but not the number and sizes of
//! objects.

#![forbid(unsafe_code)]

mod backend;
mod chunk;
mod lease;
mod local;
mod lookaside;
mod manifest;
#[cfg(feature = "s3")]
mod s3;
mod store;

pub use backend::{check_name, BackendError, ChunkBackend, MAX_NAME_LEN};
pub use chunk::{
    chunk_ref, open_chunk, seal_chunk, ChunkFault, ChunkRef, SealedChunk, UserSecret, CHUNK_FORMAT,
    CHUNK_SIZE, MAX_CHUNK_OBJECT_LEN,
};
/// The lease decoders, bare, for the `store_lease` fuzz target.
#[cfg(fuzzing)]
pub use lease::fuzz_decode as fuzz_lease_decode;
pub use lease::{
    lease_object_name, new_run_id, open_lease, seal_lease, Lease, LeaseError, LEASE_FORMAT,
    LEASE_MAGIC, MAX_LEASE_CHUNKS, MAX_LEASE_LEN, RUN_ID_LEN,
};
pub use local::LocalDir;
pub use lookaside::{
    chunk_matches, Location, Lookaside, LookasideIndex, LookasideRead, LookasideScan,
};
pub use manifest::{
    chunk_count, manifest_object_name, open_manifest, seal_manifest, valid_env_name,
    valid_image_name, ImageEntry, Manifest, ManifestError, BODY_FORMAT, BODY_MAGIC, MAX_ENV_LEN,
    MAX_IMAGES, MAX_IMAGE_LEN, MAX_IMAGE_NAME_LEN, MAX_MANIFEST_LEN, SEALED_FORMAT, SEALED_MAGIC,
};
#[cfg(feature = "s3")]
pub use s3::{S3Config, S3};
pub use store::{GcReport, RestoreStats, Store, StoreError, SuspendProgress, SuspendStats};
