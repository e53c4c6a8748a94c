//! `Session::handle_input_in_place` against `handle_input`: the same
//! records, cut into reads at arbitrary places (inside a record's length,
//! inside its body, several records in one read, one byte at a time),
//! deliver the same bytes of the same streams in order, and the in-place
//! path keeps no input buffer once every record it was given is whole.

mod common;

use std::time::Instant;

use common::{numbered, pair, read_all, server_config};
use proptest::prelude::*;
use roam_proto::{Event, Keypair, Session, StreamId, TransportId};

/// What the client sends: stream data in writes of these sizes, taken in
/// turn until `total` bytes of a numbered pattern are out, as records
/// (one `poll_transmit` per write, so record sizes follow the writes).
fn client_records(
    c: &mut Session,
    id: StreamId,
    now: Instant,
    sizes: &[usize],
    total: usize,
) -> (Vec<u8>, Vec<u8>) {
    let data = numbered(0, total.div_ceil(4) as u32);
    let data = &data[..total];
    let mut wire = Vec::new();
    let (mut at, mut k) = (0, 0);
    while at < total {
        let n = sizes[k % sizes.len()].min(total - at);
        k += 1;
        let took = c.write(id, &data[at..at + n]).expect("room to write");
        at += took;
        while c.poll_transmit(now, &mut wire).is_some() {}
    }
    (data.to_vec(), wire)
}

/// Feeds `wire` to `s` on `st`, cut at `cuts` (offsets, any order), in
/// place or copied, and reads the stream back after every piece.
fn deliver(
    s: &mut Session,
    st: TransportId,
    now: Instant,
    wire: &[u8],
    cuts: &[usize],
    in_place: bool,
) -> Vec<u8> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
    points.push(0);
    points.push(wire.len());
    points.sort_unstable();
    points.dedup();
    let mut got = Vec::new();
    let mut id = None;
    for w in points.windows(2) {
        let mut piece = wire[w[0]..w[1]].to_vec();
        if in_place {
            s.handle_input_in_place(now, st, &mut piece)
                .expect("server input");
        } else {
            s.handle_input(now, st, &piece).expect("server input");
        }
        while let Some(ev) = s.poll_event() {
            if let Event::StreamOpened { stream } = ev {
                id = Some(stream);
            }
        }
        if let Some(id) = id {
            got.extend(read_all(s, id));
        }
    }
    got
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn any_split_of_the_records_delivers_the_same_bytes(
        sizes in prop::collection::vec(1usize..70_000, 1..6),
        total in 1usize..400_000,
        cuts in prop::collection::vec(any::<usize>(), 0..40),
    ) {
        let now = Instant::now();
        let key = Keypair::generate().unwrap();
        let cfg = server_config(&key);
        let mut got = Vec::new();
        for in_place in [false, true] {
            let (mut c, _ct, mut s, st) = pair(&cfg, &key, now);
            let id = c.open_stream(b"").unwrap();
            let (sent, wire) = client_records(&mut c, id, now, &sizes, total);
            let read = deliver(&mut s, st, now, &wire, &cuts, in_place);
            prop_assert_eq!(read.len(), sent.len());
            prop_assert!(read == sent, "bytes differ (in place: {})", in_place);
            got.push(read);
        }
        prop_assert_eq!(&got[0], &got[1]);
    }
}

#[test]
fn records_cut_one_byte_at_a_time() {
    let now = Instant::now();
    let key = Keypair::generate().unwrap();
    let cfg = server_config(&key);
    let (mut c, _ct, mut s, st) = pair(&cfg, &key, now);
    let id = c.open_stream(b"").unwrap();
    let (sent, wire) = client_records(&mut c, id, now, &[1, 65_000, 17, 4096], 140_000);
    // Every record's length and body cut at every byte.
    let cuts: Vec<usize> = (0..wire.len()).collect();
    assert_eq!(deliver(&mut s, st, now, &wire, &cuts, true), sent);
}

#[test]
fn whole_records_need_no_input_buffer() {
    let now = Instant::now();
    let key = Keypair::generate().unwrap();
    let cfg = server_config(&key);
    for in_place in [true, false] {
        let (mut c, _ct, mut s, st) = pair(&cfg, &key, now);
        assert_eq!(s.input_buffer_capacity(), 0, "after the handshake");
        let id = c.open_stream(b"").unwrap();
        let (sent, wire) = client_records(&mut c, id, now, &[1000, 3], 50_000);
        // Several whole records in each read.
        let cuts: Vec<usize> = (1..8).map(|k| k * wire.len() / 8).collect();
        let cuts: Vec<usize> = cuts
            .into_iter()
            .map(|cut| record_boundary_at_or_after(&wire, cut))
            .collect();
        assert_eq!(deliver(&mut s, st, now, &wire, &cuts, in_place), sent);
        if in_place {
            assert_eq!(s.input_buffer_capacity(), 0, "in place");
        } else {
            assert!(s.input_buffer_capacity() > 0, "copied");
        }
    }
}

/// The first record boundary of `wire` at or after `at`.
fn record_boundary_at_or_after(wire: &[u8], at: usize) -> usize {
    let mut pos = 0;
    while pos < at && pos + 2 <= wire.len() {
        pos += 2 + usize::from(u16::from_be_bytes([wire[pos], wire[pos + 1]]));
    }
    pos.min(wire.len())
}
