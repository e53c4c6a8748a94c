//! What the web-server example (`examples/web_server.rs`) and its test
//! (`tests/service_web.rs`) agree on: the size of each dynamic order's
//! page, the page's bytes, and the ledger line an order leaves.
//!
//! A page is generated frame by frame (a frame's bytes depend only on the
//! order and the frame's index), so a back-end restarted in the middle of
//! a page goes on from a frame boundary without the frames before it.

#![allow(dead_code, unreachable_pub)]

/// Bytes of one frame of a dynamic page (the back-end's unit of output).
pub const FRAME: usize = 64 << 10;

/// The largest dynamic page (bytes).
pub const MAX_PAGE: u64 = 1 << 20;

/// SplitMix64's finaliser: a well-mixed 64-bit value from any input.
pub fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The page size the client asks for in order `id` of a run seeded `seed`
/// (1 byte to [`MAX_PAGE`]).
pub fn order_size(seed: u64, id: u64) -> u64 {
    1 + mix(seed ^ id.wrapping_mul(0xa076_1d64_78bd_642f)) % MAX_PAGE
}

/// Frame `index` of order `id`'s page, `len` bytes (at most [`FRAME`]).
pub fn page_frame(id: u64, index: u64, len: usize) -> Vec<u8> {
    let mut state = mix(id << 32 ^ index);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = mix(state);
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Order `id`'s whole page of `size` bytes.
pub fn page(id: u64, size: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(size as usize);
    let mut index = 0;
    while (out.len() as u64) < size {
        let len = (size - out.len() as u64).min(FRAME as u64) as usize;
        out.extend_from_slice(&page_frame(id, index, len));
        index += 1;
    }
    out
}

/// The line order `id` appends to the ledger (the effect outside the set).
pub fn ledger_line(id: u64, size: u64) -> String {
    format!("order {id} page {size}\n")
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `id` and `size` of `/order?id=I&size=S`.
pub fn order_query(target: &str) -> Option<(u64, u64)> {
    let query = target.strip_prefix("/order?")?;
    let (mut id, mut size) = (None, None);
    for pair in query.split('&') {
        match pair.split_once('=')? {
            ("id", v) => id = v.parse().ok(),
            ("size", v) => size = v.parse().ok(),
            _ => {}
        }
    }
    Some((id?, size?))
}

/// The seed of a test run: `ROAM_TEST_SEED` or a fixed one, printed so that a
/// failure replays.
pub fn seed() -> u64 {
    let seed = std::env::var("ROAM_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    eprintln!("seed {seed} (ROAM_TEST_SEED)");
    seed
}
