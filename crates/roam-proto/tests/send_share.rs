//! How much a session lets its streams buffer for sending when many write
//! at once (PROTOCOL.md §8): the configured session send buffer while a few
//! hundred streams contend, grown (at most four times) while more do, so
//! that each of 1,000 writers keeps a 64 KiB share instead of 16 KiB, and
//! never more than the growth cap however many streams write.

mod common;

use std::time::Instant;

use common::{pair, server_config};
use roam_proto::{Keypair, Session};

const MIB: u64 = 1 << 20;

/// Opens `streams` streams on a fresh client session whose transport is
/// never drained and lets each write 4 MiB once; returns the session and
/// what each stream's write took.
fn fill(streams: usize) -> (Session, Vec<u64>) {
    let now = Instant::now();
    let key = Keypair::generate().unwrap();
    let (mut client, _ct, _server, _st) = pair(&server_config(&key), &key, now);
    let data = vec![0x5au8; 4 * MIB as usize];
    let mut took = Vec::with_capacity(streams);
    for _ in 0..streams {
        let id = client.open_stream(b"").unwrap();
        took.push(client.write(id, &data).unwrap() as u64);
    }
    (client, took)
}

#[test]
fn a_hundred_writers_share_the_configured_send_buffer() {
    let (client, took) = fill(100);
    // Default session send buffer: 16 MiB, each stream at most 1 MiB.
    assert_eq!(client.send_buffered(), 16 * MIB);
    assert_eq!(took.iter().sum::<u64>(), 16 * MIB);
    assert!(took.iter().all(|&t| t <= MIB));
}

#[test]
fn a_thousand_writers_grow_the_send_buffer_to_keep_a_64_kib_share() {
    let (client, took) = fill(1000);
    let held = client.send_buffered();
    assert!(
        held > 16 * MIB && held <= 1000 * 64 * 1024,
        "held {held} bytes"
    );
    // Once more than 256 streams contend, each newcomer is given room.
    let late = &took[300..];
    assert!(
        late.iter().all(|&t| t >= 32 * 1024),
        "a late stream took {:?}",
        late.iter().min()
    );
}

#[test]
fn the_send_buffer_never_grows_past_four_times_its_size() {
    let (client, _took) = fill(5000);
    assert!(client.send_buffered() <= 64 * MIB);
    assert!(client.send_buffered() > 60 * MIB);
}
