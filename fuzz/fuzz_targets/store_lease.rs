//! roam-store's trickle leases (`crates/roam-store/src/lease.rs`,
//! docs/STORE.md "Trickle leases").
//!
//! The first byte picks the mode. Even: the rest is split into an object
//! name and a body; the bare body decoder and name parser never panic, an
//! accepted body lists exactly as many ids as its count says, and opening
//! the bytes as a sealed lease under that name never panics and never
//! succeeds (only a writer with the secret can seal). Odd: the rest builds
//! a lease (`arbitrary`: environment, run id, sequence, expiry, up to 64
//! chunk ids); when it seals, opening it under its own name gives it back,
//! under another sequence it fails authentication, and with any one byte
//! changed it fails.

#![no_main]

use arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use roam_store::{fuzz_lease_decode, open_lease, seal_lease, Lease, LeaseError, UserSecret};

fn lease(u: &mut Unstructured<'_>) -> Result<Lease> {
    let env = if u.ratio(1, 8)? {
        let len = u.int_in_range(0..=12)?;
        String::from_utf8_lossy(u.bytes(len)?).into_owned()
    } else {
        "env".into()
    };
    let run = if u.ratio(1, 8)? {
        let len = u.int_in_range(0..=40)?;
        String::from_utf8_lossy(u.bytes(len)?).into_owned()
    } else {
        let raw: [u8; 16] = u.arbitrary()?;
        raw.iter().map(|b| format!("{b:02x}")).collect()
    };
    let mut chunks = Vec::new();
    for _ in 0..u.int_in_range(0..=64)? {
        chunks.push(u.arbitrary()?);
    }
    Ok(Lease {
        env,
        run,
        seq: u.arbitrary()?,
        expires_unix_ms: u.arbitrary()?,
        chunks,
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let secret = UserSecret::from_bytes([7; 32]);
    if mode % 2 == 0 {
        let cut = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        let name = String::from_utf8_lossy(&rest[..cut]);
        let body = rest.get(cut + 1..).unwrap_or_default();
        let (decoded, _) = fuzz_lease_decode(body, &name);
        if let Ok((_, ids)) = decoded {
            assert_eq!(body.len(), 12 + 32 * ids.len(), "every id, nothing more");
        }
        assert!(
            open_lease(&secret, &name, body).is_err(),
            "unsealed bytes opened"
        );
        return;
    }
    let Ok(l) = lease(&mut Unstructured::new(rest)) else {
        return;
    };
    let Ok(sealed) = seal_lease(&secret, &l) else {
        return;
    };
    let name = l.object_name();
    assert_eq!(
        open_lease(&secret, &name, &sealed).as_ref(),
        Ok(&l),
        "sealed round trip"
    );
    let other = Lease {
        seq: l.seq.wrapping_add(1),
        ..l.clone()
    };
    assert_eq!(
        open_lease(&secret, &other.object_name(), &sealed),
        Err(LeaseError::Authentication),
        "opened under another name"
    );
    let at = usize::from(mode / 2) % sealed.len();
    let mut altered = sealed.clone();
    altered[at] ^= 1;
    assert!(
        open_lease(&secret, &name, &altered).is_err(),
        "altered byte {at} opened"
    );
});
