//! roam-store's manifest (`crates/roam-store/src/manifest.rs`, docs/STORE.md
//! "Manifest body").
//!
//! The first byte picks the mode. Even: the rest is decoded as a plaintext
//! manifest body; decoding never panics, and an accepted body is canonical
//! (it re-encodes to the same bytes). Odd: the rest builds a manifest
//! (`arbitrary`: names, version, images of up to 8 chunks, now and then a
//! chunk list that does not match the length); when it encodes, the bytes
//! decode to the same manifest, and sealing then opening it under the same
//! environment and version gives it back too.

#![no_main]

use arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use roam_store::{
    open_manifest, seal_manifest, ChunkRef, ImageEntry, Manifest, UserSecret, CHUNK_SIZE,
};

fn name(u: &mut Unstructured<'_>) -> Result<String> {
    let len = u.int_in_range(0..=12)?;
    let bytes = u.bytes(len)?;
    Ok(String::from_utf8_lossy(bytes).into_owned())
}

fn manifest(u: &mut Unstructured<'_>) -> Result<Manifest> {
    let env = if u.ratio(1, 8)? { name(u)? } else { "env".into() };
    let mut images = Vec::new();
    for _ in 0..u.int_in_range(0..=4)? {
        let n: u64 = u.int_in_range(0..=8)?;
        let len = if n == 0 {
            0
        } else {
            (n - 1) * CHUNK_SIZE as u64 + u.int_in_range(1..=CHUNK_SIZE as u64)?
        };
        let listed = if u.ratio(1, 16)? { n + 1 } else { n };
        let mut chunks = Vec::new();
        for _ in 0..listed {
            chunks.push(ChunkRef {
                hash: u.arbitrary()?,
                id: u.arbitrary()?,
            });
        }
        images.push(ImageEntry {
            name: name(u)?,
            len,
            chunks,
        });
    }
    Ok(Manifest {
        env,
        version: u.arbitrary()?,
        images,
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        if let Ok(m) = Manifest::decode(rest) {
            let again = m.encode().expect("a decoded manifest encodes");
            assert_eq!(again, rest, "decoding is canonical");
        }
        return;
    }
    let Ok(m) = manifest(&mut Unstructured::new(rest)) else {
        return;
    };
    let Ok(bytes) = m.encode() else {
        return;
    };
    assert_eq!(Manifest::decode(&bytes).as_ref(), Ok(&m), "round trip");
    let secret = UserSecret::from_bytes([7; 32]);
    let sealed = seal_manifest(&secret, &m).expect("an encodable manifest seals");
    assert_eq!(
        open_manifest(&secret, &m.env, m.version, &sealed).as_ref(),
        Ok(&m),
        "sealed round trip"
    );
});
